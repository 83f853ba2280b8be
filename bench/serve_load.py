"""Bounded load on `runnerkit serve`: no job lost or duplicated, FIFO order, flat server memory.

One real server (`python -m runnerkit.infer serve`, tiny t2v config by default, CPU, `--warmup`,
`--max_queue 64`, `--keep_jobs 10`); `--clients` threads share `--jobs` submissions (seeds
0..N-1, one `POST /v1/videos` each, sent as a burst: every job is queued within a second or so),
then each client polls its own jobs, oldest first, until every one is final.

    python -m bench.serve_load --out bench/results/serve_load_cpu

Checks (each recorded as a boolean in OUT.json; the process exits 1 if one fails): every
submitted id is unique; every job ends in a final state; the ids of `GET /v1/videos` are exactly
the submitted ones, each once; jobs start in submission order; retention kept the files of the
last `--keep_jobs` jobs only (their content 200 video/mp4, an older one's 410).

Measured: per job, queue wait (`started_at - created_at`) and run seconds (`completed_at -
started_at`) as median [min–max]; wall seconds from the first submission to the last final job;
jobs per minute over that wall; the server's RSS (`VmRSS` of /proc/PID/status, sampled every
0.5 s) when ready, when the 10th and the last job ended, and its maximum. Memory is called flat
when RSS after the last job is within `--flat_pct` percent of RSS after the 10th.

Writes OUT.json (raw numbers, every RSS sample), OUT.md (the table) and OUT.log (this script's
lines, then the server log's last lines).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, fmt_spread, markdown_table, spread  # noqa: E402

FINAL = ("completed", "failed", "cancelled")
LINES: list[str] = []


def say(msg: str) -> None:
    line = f"{time.strftime('%H:%M:%S')} {msg}"
    LINES.append(line)
    print(line, flush=True)


def http(method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def rss_kib(pid: int) -> int | None:
    try:
        m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None
    return int(m.group(1)) if m else None


class RssSampler(threading.Thread):
    """VmRSS of `pid` every `period` seconds: [(time.time(), KiB)]."""

    def __init__(self, pid: int, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            v = rss_kib(self.pid)
            if v is not None:
                self.samples.append((time.time(), v))
            self.stop.wait(self.period)

    def at(self, t: float) -> tuple[float, int]:
        """The first sample at or after `t` (the last one if none)."""
        return next((s for s in self.samples if s[0] >= t), self.samples[-1])


def start_server(args: argparse.Namespace, work: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    log = work / "server.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RUNNERKIT_CACHE": str(work / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "runnerkit.infer", "serve", "--config_json", args.config, "--device", args.device,
           "--port", "0", "--warmup", "--max_queue", str(args.max_queue), "--keep_jobs", str(args.keep_jobs),
           "--output_dir", str(work / "jobs"), "--on_shutdown", "cancel"]
    say("server: " + " ".join(["runnerkit serve"] + cmd[4:-4]))
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=sink)
    deadline = time.monotonic() + 120
    url = None
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"listening on (http://[\d.]+:\d+)", log.read_text(errors="replace"))
        if m and url is None:
            url = m.group(1)
        if url and http("GET", url + "/health/ready")[0] == 200:
            return proc, url, log
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not become ready:\n{log.read_text()[-3000:]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/wan/wan_t2v_tiny.json", help="runner config, relative to the repo")
    p.add_argument("--device", default="cpu")
    p.add_argument("--jobs", type=int, default=50)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max_queue", type=int, default=64)
    p.add_argument("--keep_jobs", type=int, default=10)
    p.add_argument("--poll_s", type=float, default=0.5, help="a client's wait between polls of a running job")
    p.add_argument("--flat_pct", type=float, default=5.0)
    p.add_argument("--timeout_s", type=float, default=1200)
    p.add_argument("--out", default="bench/results/serve_load_cpu")
    args = p.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    work = Path(tempfile.mkdtemp(prefix="serve_load_"))
    load_before = os.getloadavg()
    proc, url, log = start_server(args, work)
    sampler = RssSampler(proc.pid)
    sampler.start()
    time.sleep(1.0)
    rss_ready = sampler.samples[-1]
    say(f"ready at {url}; server RSS {rss_ready[1] / 1024:.1f} MiB; load average {load_before[0]:.2f}")

    seeds = list(range(args.jobs))
    seeds_lock = threading.Lock()
    submitted: list[dict[str, Any]] = []  # {"seed", "id", "client"}
    final: dict[str, dict[str, Any]] = {}  # id -> the final job object
    retries = {"429": 0, "other": 0}
    errors: list[str] = []
    lock = threading.Lock()
    t_first_submit = time.time()
    deadline = time.monotonic() + args.timeout_s

    def client(index: int) -> None:
        mine: list[str] = []
        while True:
            with seeds_lock:
                if not seeds:
                    break
                seed = seeds.pop(0)
            while True:
                code, headers, body = http("POST", url + "/v1/videos", {"prompt": f"load test {seed}", "seed": seed})
                if code == 200:
                    job_id = json.loads(body)["id"]
                    with lock:
                        submitted.append({"seed": seed, "id": job_id, "client": index})
                    mine.append(job_id)
                    break
                with lock:
                    retries["429" if code == 429 else "other"] += 1
                if code != 429 or time.monotonic() > deadline:
                    errors.append(f"seed {seed}: POST {code} {body[:200]!r}")
                    break
                time.sleep(float(headers.get("retry-after", "1")))
        for job_id in mine:  # FIFO: a client's oldest job ends first
            while time.monotonic() < deadline:
                code, _, body = http("GET", f"{url}/v1/videos/{job_id}")
                job = json.loads(body) if code == 200 else None
                if job is not None and job["status"] in FINAL:
                    with lock:
                        final[job_id] = job
                    break
                if code != 200:
                    errors.append(f"{job_id}: GET {code} {body[:200]!r}")
                    break
                time.sleep(args.poll_s)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    last_report = 0
    while any(t.is_alive() for t in threads):
        time.sleep(1.0)
        if len(final) >= last_report + 10:
            last_report = len(final) // 10 * 10
            say(f"{len(final)}/{args.jobs} final; server RSS {sampler.samples[-1][1] / 1024:.1f} MiB")
    t_last_final = max((j["completed_at"] for j in final.values()), default=time.time())

    # the server's view: the list, retention, content
    code, _, body = http("GET", url + "/v1/videos")
    listed_jobs = {j["id"]: j for j in json.loads(body)["data"]} if code == 200 else {}
    listed = [j["id"] for j in json.loads(body)["data"]] if code == 200 else []
    ids = [s["id"] for s in submitted]
    by_start = sorted(final.values(), key=lambda j: j["started_at"] or 0)
    by_created = sorted(final.values(), key=lambda j: j["created_at"])
    ended = sorted(final.values(), key=lambda j: j["completed_at"])
    kept = [j for j in ended if listed_jobs.get(j["id"], {}).get("content_available")]  # now, not when it ended
    content_ok = None
    if kept:
        code_c, headers_c, body_c = http("GET", f"{url}/v1/videos/{kept[-1]['id']}/content")
        content_ok = code_c == 200 and headers_c.get("content-type") == "video/mp4" and body_c[4:8] == b"ftyp"
    gone_code = http("GET", f"{url}/v1/videos/{ended[0]['id']}/content")[0] if len(ended) > args.keep_jobs else None
    job_folders = sorted(d.name for d in (work / "jobs").iterdir() if d.is_dir())

    time.sleep(1.0)
    sampler.stop.set()
    sampler.join()
    proc.terminate()
    exit_code = proc.wait(timeout=60)
    load_after = os.getloadavg()

    statuses = {s: sum(j["status"] == s for j in final.values()) for s in FINAL}
    rss10 = sampler.at(ended[min(9, len(ended) - 1)]["completed_at"]) if ended else rss_ready
    rss_last = sampler.at(t_last_final)
    rss_max = max(v for _, v in sampler.samples)
    flat_pct = 100.0 * (rss_last[1] - rss10[1]) / rss10[1]
    wall = t_last_final - t_first_submit
    checks = {
        "ids_unique": len(set(ids)) == len(ids) == args.jobs,
        "all_final": len(final) == args.jobs and all(j["status"] in FINAL for j in final.values()),
        "all_completed": statuses["completed"] == args.jobs,
        "list_equals_submitted": sorted(listed) == sorted(ids) and len(listed) == len(set(listed)),
        "fifo_start_order": [j["id"] for j in by_start] == [j["id"] for j in by_created],
        "retention_kept_last_n": [j["id"] for j in kept] == [j["id"] for j in ended[-args.keep_jobs:]]
        and sorted(job_folders) == sorted(j["id"] for j in kept),
        "kept_content_is_mp4": bool(content_ok),
        "expired_content_410": gone_code in (None, 410),
        "no_client_errors": not errors,
        "server_exit_0": exit_code == 0,
        "memory_flat": abs(flat_pct) <= args.flat_pct,
    }
    result = {
        "config": args.config, "device": args.device, "jobs": args.jobs, "clients": args.clients,
        "max_queue": args.max_queue, "keep_jobs": args.keep_jobs, "poll_s": args.poll_s,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                 "load_average_before": load_before, "load_average_after": load_after},
        "checks": checks, "statuses": statuses, "retries": retries, "errors": errors,
        "queue_wait_s": spread([j["started_at"] - j["created_at"] for j in final.values()]),
        "run_s": spread([j["completed_at"] - j["started_at"] for j in final.values()]),
        "wall_s": wall, "jobs_per_minute": 60.0 * len(final) / wall if wall > 0 else None,
        "rss_mib": {"ready": rss_ready[1] / 1024, "after_10": rss10[1] / 1024, "after_last": rss_last[1] / 1024,
                    "max": rss_max / 1024, "after_last_vs_after_10_pct": flat_pct},
        "rss_samples": [(round(t - t_first_submit, 2), v) for t, v in sampler.samples],
        "listed": len(listed), "job_folders_left": len(job_folders),
        "date": time.strftime("%Y-%m-%d"),
    }
    for name, ok in checks.items():
        say(f"check {name}: {'ok' if ok else 'FAILED'}")
    say(f"statuses {statuses}; wall {wall:.1f} s; {result['jobs_per_minute']:.1f} jobs/min; "
        f"queue wait {fmt_spread(result['queue_wait_s'], 2)} s; run {fmt_spread(result['run_s'], 2)} s")
    say(f"RSS MiB: ready {rss_ready[1] / 1024:.1f}, after 10 {rss10[1] / 1024:.1f}, after {len(final)} "
        f"{rss_last[1] / 1024:.1f} ({flat_pct:+.2f} %), max {rss_max / 1024:.1f}; load average after {load_after[0]:.2f}")

    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(render_md(result, out) + "\n")
    server_tail = log.read_text(errors="replace").splitlines()[-25:]
    text = "\n".join(LINES + ["", "--- server log (last 25 lines) ---"] + server_tail) + "\n"
    out.with_suffix(".log").write_text(text.replace(str(work), "$WORK").replace(str(REPO), "."))
    return 0 if all(checks.values()) else 1


def render_md(r: dict[str, Any], out: Path) -> str:
    c, rss = r["checks"], r["rss_mib"]
    rows = [
        ["jobs (clients)", f"{r['jobs']} ({r['clients']} threads, burst submit)"],
        ["statuses", ", ".join(f"{k} {v}" for k, v in r["statuses"].items())],
        ["429 retries / other errors", f"{r['retries']['429']} / {len(r['errors'])}"],
        ["queue wait, s", fmt_spread(r["queue_wait_s"], 2)],
        ["run, s", fmt_spread(r["run_s"], 2)],
        ["wall (first submit → last final), s", f"{r['wall_s']:.1f}"],
        ["jobs / minute", f"{r['jobs_per_minute']:.1f}"],
        ["server RSS ready, MiB", f"{rss['ready']:.1f}"],
        ["server RSS after 10 jobs, MiB", f"{rss['after_10']:.1f}"],
        [f"server RSS after {r['jobs']} jobs, MiB", f"{rss['after_last']:.1f} ({rss['after_last_vs_after_10_pct']:+.2f} % vs after 10)"],
        ["server RSS max, MiB", f"{rss['max']:.1f}"],
    ]
    checks = [[k, "ok" if v else "**FAILED**"] for k, v in c.items()]
    la0, la1 = r["host"]["load_average_before"][0], r["host"]["load_average_after"][0]
    return "\n".join([
        f"# `runnerkit serve` under a bounded load (CPU, {r['date']})",
        "",
        f"`python -m bench.serve_load --out {out}` (log: `{out.name}.log`, raw: `{out.name}.json`).",
        f"Server: `{r['config']}` (Wan2.1 tiny, synthetic weights, 48×80×9, 4 steps, CFG) on `--device "
        f"{r['device']}`, `--warmup --max_queue {r['max_queue']} --keep_jobs {r['keep_jobs']}`; clients poll "
        f"every {r['poll_s']} s.",
        "",
        f"**These are CPU numbers from a {r['host']['cpus']}-core development VM shared with other jobs "
        f"(load average {la0:.1f} before, {la1:.1f} after)**: the seconds measure that machine's contention as "
        "much as the server; the checks and the memory trend are the result, not the throughput.",
        "",
        markdown_table(["measure", "value"], rows),
        "",
        markdown_table(["check", "result"], checks),
        "",
        f"Memory: RSS after all {r['jobs']} jobs is {rss['after_last_vs_after_10_pct']:+.2f} % of RSS after "
        f"10 jobs ({rss['after_10']:.1f} → {rss['after_last']:.1f} MiB; flat means within ±5 %), "
        f"{rss['after_10'] - rss['ready']:+.1f} MiB between ready and job 10 (first-request allocations).",
    ])


if __name__ == "__main__":
    sys.exit(main())

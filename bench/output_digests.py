"""Output digests of every tiny config on the CPU: proof that a refactor left outputs bit-identical.

    python -m bench.output_digests [--out bench/results/output_digests_cpu.json]
    python -m bench.output_digests --compare bench/results/output_digests_cpu.json

For every tiny config under configs/ (`configs/*/*tiny*.json`) and the task it serves (its `task`):
the config's synthetic checkpoint is written by the runner itself (`synthetic_checkpoint`, its seed)
into a fresh cache folder (`RUNNERKIT_CACHE` set to a temporary folder), one request runs on the CPU at
the config's default shape with seed 0 and the prompt below, its image inputs (the task's
`IMAGE_INPUTS`: first frame, last frame) are fixed noise PNGs at the default shape, and the sha256 of
every tensor of its `--save_tensor_path` file (the raw bytes of the contiguous tensor; 'video',
'image', 'audio') is recorded:

    {config path: {task: {output key: sha256}}, "_machine": {cpu, flags, torch, threads}}

`--compare FILE` reruns everything and prints every difference from FILE (a digest that changed, a
config, task or output that appeared or disappeared), exit status 1 if any, 0 if none.

What it proves and what not: the same machine, torch build and thread count give bit-identical
outputs before and after a change. Float rounding differs by instruction set (AVX2 vs AVX-512 kernels)
and by the number of intra-op threads (reductions split differently), so digests from another
machine prove nothing: compare only against a file written on the same machine (its `_machine` entry
says which CPU flags it had; a run on other flags prints a warning). One intra-op thread by default
(`--threads`). About a minute for all configs on 2 cores (their default shapes and steps).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / "results" / "output_digests_cpu.json"
PROMPT = "a red fox runs through fresh snow"
SEED = 0
#: The x86 flags that pick the CPU kernels (and so the rounding) of float32 math in torch.
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
             "amx_bf16", "amx_tile")


def tiny_configs() -> list[Path]:
    """Every tiny config, sorted by path."""
    return sorted((REPO / "configs").glob("*/*tiny*.json"))


def machine() -> dict[str, Any]:
    """The CPU model, its ISA flags (of `ISA_FLAGS`), the torch version and its intra-op threads."""
    import torch

    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    return {"cpu": model, "flags": [f for f in ISA_FLAGS if f in flags], "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def digests_of(path: Path) -> dict[str, str]:
    """output key -> sha256 of the tensor's raw bytes, for every tensor of the safetensors file `path`."""
    import torch
    from safetensors.torch import load_file

    return {key: hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for key, tensor in sorted(load_file(str(path)).items())}


def run_config(config_path: Path, folder: Path) -> dict[str, dict[str, str]]:
    """{task: {output key: sha256}} of one request of `config_path` on the CPU (see the module docstring)."""
    import torch

    from runnerkit.config import RequestConfig, load_runner_config
    from runnerkit.images import write_image
    from runnerkit.registry import get_runner_cls

    config = load_runner_config(config_path, {"device": "cpu"})
    cls = get_runner_cls(config.model_cls, config.task)
    runner = cls(config)
    height, width, _ = runner.request_shape(RequestConfig(prompt=PROMPT))
    images: dict[str, str] = {}
    for i, name in enumerate(cls.IMAGE_INPUTS.get(config.task, ())):  # fixed noise, one image per input
        path = folder / f"{config_path.stem}_{name}.png"
        write_image(path, torch.rand(3, height, width, generator=torch.Generator().manual_seed(i + 1)) * 2 - 1)
        images[name] = str(path)
    runner.init_modules()
    out = folder / f"{config_path.stem}.safetensors"
    runner.run_pipeline(RequestConfig(prompt=PROMPT, seed=SEED, save_tensor_path=str(out), **images), 0)
    return {config.task: digests_of(out)}


def run_all(threads: int) -> dict[str, Any]:
    """Every tiny config's digests, and `_machine`."""
    import torch
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="ERROR")  # the synthetic-checkpoint notices are expected
    torch.set_num_threads(threads)
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="output_digests_") as tmp:
        os.environ["RUNNERKIT_CACHE"] = str(Path(tmp) / "cache")  # the synthetic checkpoints, written fresh
        for config_path in tiny_configs():
            name = str(config_path.relative_to(REPO))
            result[name] = run_config(config_path, Path(tmp))
            print(f"{name}: {json.dumps(result[name])}", flush=True)
    result["_machine"] = machine()
    return result


def differences(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """Every digest of `want` that `got` lacks or changed, and every one `got` adds (one line each)."""
    def flat(digests: dict[str, Any]) -> dict[tuple[str, str, str], str]:
        return {(config, task, key): digest for config, tasks in digests.items() if not config.startswith("_")
                for task, outputs in tasks.items() for key, digest in outputs.items()}

    lines, want_flat, got_flat = [], flat(want), flat(got)
    for where in sorted(want_flat.keys() | got_flat.keys()):
        a, b = want_flat.get(where), got_flat.get(where)
        if a != b:
            lines.append(f"{where[0]} {where[1]} {where[2]}: {a or 'absent'} -> {b or 'absent'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.output_digests", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the digests (without --compare)")
    p.add_argument("--compare", type=Path, default=None, help="rerun and compare with this digests file; "
                   "exit 1 on any difference")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (digests depend on it)")
    args = p.parse_args(argv)
    want = json.loads(args.compare.read_text()) if args.compare is not None else None
    got = run_all(args.threads)
    if want is None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.out}")
        return 0
    if want.get("_machine") != got["_machine"]:
        print(f"warning: {args.compare} was written on {want.get('_machine')}, this run is on {got['_machine']}: "
              "digests of other CPU flags, torch builds or thread counts may differ without any change")
    lines = differences(want, got)
    for line in lines:
        print(f"MISMATCH {line}")
    print(f"{len(lines)} mismatch(es) against {args.compare}" if lines else f"bit-identical to {args.compare}")
    return 1 if lines else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The launch script (`runnerkit.infer.main`, `python -m runnerkit`): determinism, batches, outputs,
the profile report, and input validation (exit codes, messages, no tracebacks).

Most cases run in-process through `main([...])` (loguru is re-added to `sys.stderr` inside `main`,
so `capsys` sees its lines); cross-process determinism runs two real subprocesses.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from runnerkit import synthetic
from safetensors.torch import load_file, save_file

from runnerkit import memory
from runnerkit.infer import main
from runnerkit.media import to_uint8_frames
from test_cases.conftest import REPO, tiny_config_dict, write_config
from test_cases._cli import no_gc_freeze, restore_logger, run_launch_script  # noqa: F401 (autouse fixtures)
from test_cases._cli import run_cli as _cli

# The tiny config's default shape and steps (configs/wan/wan_t2v_tiny.json).
H, W, F = 48, 80, 9
STEPS = 4

# Three requests of the batch tests: different prompts and seeds, the second with another shape.
REQUESTS: list[dict[str, Any]] = [
    {"prompt": "a red fox in the snow", "seed": 1},
    {"prompt": "ocean waves at dusk", "seed": 2, "target_height": 32, "target_width": 32, "target_video_length": 5},
    {"prompt": "a city at night", "seed": 3},
]


def _flags(request: dict[str, Any]) -> list[str]:
    out = []
    for key, value in request.items():
        out += [f"--{key}", str(value)]
    return out


def _video(path: Path) -> torch.Tensor:
    tensors = load_file(str(path))
    assert sorted(tensors) == ["video"], f"{path} keys {sorted(tensors)}"
    return tensors["video"]


def _assert_video(video: torch.Tensor, shape: tuple[int, int, int]) -> None:
    h, w, f = shape
    assert video.dtype == torch.float32
    assert tuple(video.shape) == (3, f, h, w)
    assert torch.isfinite(video).all()
    assert video.min() >= -1.0 and video.max() <= 1.0
    assert video.std() > 1e-3, "decoded video is constant"


@pytest.fixture(scope="module")
def config_path(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny config (CPU, 4 steps, 48x80x9) pointing at the session checkpoint."""
    return write_config(tmp_path_factory.mktemp("cfg") / "tiny.json", tiny_config_dict(tiny_ckpt))


@pytest.fixture(scope="module")
def isolated(config_path: Path, tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    """Each of REQUESTS run alone: its own `main` call (a fresh runner) with the single-request flags."""
    out_dir = tmp_path_factory.mktemp("isolated")
    videos = []
    for n, req in enumerate(REQUESTS):
        path = out_dir / f"{n}.safetensors"
        rc = main(["--config_json", str(config_path), *_flags(req), "--save_tensor_path", str(path)])
        assert rc == 0, f"isolated request {n} exited {rc}"
        videos.append(_video(path))
    return videos


def _write_requests(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


# ---- determinism ------------------------------------------------------------------------------
def test_same_seed_bit_identical_across_processes(config_path: Path, isolated: list[torch.Tensor],
                                                  tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    outs = [tmp_path / f"proc{i}.safetensors" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "runnerkit", "--config_json", str(config_path),
                               *_flags(REQUESTS[0]), "--save_tensor_path", str(out)],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for out in outs]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
    a, b = _video(outs[0]), _video(outs[1])
    _assert_video(a, (H, W, F))
    assert torch.equal(a, b)
    # ... and equal to the same request served in-process (another process again).
    assert torch.equal(a, isolated[0])


def test_different_seeds_differ(config_path: Path, isolated: list[torch.Tensor], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "seed5.safetensors"
    rc, err = _cli(capsys, "--config_json", config_path, *_flags({**REQUESTS[0], "seed": 5}), "--save_tensor_path", out)
    assert rc == 0, err
    other = _video(out)
    _assert_video(other, (H, W, F))
    assert not torch.equal(other, isolated[0])
    assert (other - isolated[0]).abs().mean() > 1e-3


# ---- --requests batches ------------------------------------------------------------------------
def test_requests_file_matches_isolated_runs(config_path: Path, isolated: list[torch.Tensor], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    lines = [{**req, "save_tensor_path": str(tmp_path / f"b{n}.safetensors")} for n, req in enumerate(REQUESTS)]
    reqs = _write_requests(tmp_path / "reqs.jsonl", lines)
    rc, err = _cli(capsys, "--config_json", config_path, "--requests", reqs)
    assert rc == 0, err
    assert "Traceback" not in err
    for n, req in enumerate(REQUESTS):
        video = _video(tmp_path / f"b{n}.safetensors")
        shape = (req.get("target_height", H), req.get("target_width", W), req.get("target_video_length", F))
        _assert_video(video, shape)
        assert torch.equal(video, isolated[n]), f"request {n} differs from its isolated run"


def test_failed_request_mid_batch_is_reported_and_others_unaffected(
        config_path: Path, isolated: list[torch.Tensor], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import runnerkit.media as media

    real_save = media.save_tensors

    def disk_full_on_b1(tensors: dict[str, torch.Tensor], path: Any) -> None:
        if Path(path).name.startswith(".b1."):  # fails after the whole request was generated
            raise OSError(28, "No space left on device")
        real_save(tensors, path)

    monkeypatch.setattr(media, "save_tensors", disk_full_on_b1)
    paths = [tmp_path / "b0.safetensors", tmp_path / "b1.safetensors", tmp_path / "b2.safetensors"]
    lines = [{**req, "save_tensor_path": str(p)} for req, p in zip(REQUESTS, paths, strict=True)]
    reqs = _write_requests(tmp_path / "reqs.jsonl", lines)
    rc, err = _cli(capsys, "--config_json", config_path, "--requests", reqs)
    assert rc == 1, err
    assert "request 1 (line 2 of" in err and "failed: MediaWriteError: could not write `save_tensor_path`" in err
    assert "No space left on device" in err
    assert "request 0 (" not in err and "request 2 (" not in err
    assert "1 of 3 requests failed: [1]" in err
    assert "Traceback" not in err and not paths[1].exists()
    assert not list(tmp_path.glob(".*partial*")), "a failed request must leave no partial file"
    # The requests before and after the failure are exactly their isolated outputs.
    assert torch.equal(_video(paths[0]), isolated[0])
    assert torch.equal(_video(paths[2]), isolated[2])


def test_unexpected_error_prints_its_traceback(config_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug (not an input error) shows where it happened at the default log level, naming the pipeline stage
    it was raised in; exit 1."""
    from runnerkit.models.wan.runner import WanT2VRunner

    def broken_step(*_: Any) -> torch.Tensor:
        raise RuntimeError("a bug in a step")

    monkeypatch.setattr(WanT2VRunner, "run_step", broken_step)
    rc, err = _cli(capsys, "--config_json", config_path, "--prompt", "x")
    assert rc == 1, err
    assert "request 0 (command line) failed in stage transformer: RuntimeError: a bug in a step" in err, err
    assert "Traceback" in err and "in broken_step" in err, err


# ---- saved media ----------------------------------------------------------------------------------
def test_save_result_mp4_png_and_sidecar(config_path: Path, tiny_ckpt: Path, isolated: list[torch.Tensor],
                                         tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import imageio.v3 as iio
    import imageio_ffmpeg

    mp4, png, png_tensor = tmp_path / "sub" / "x.mp4", tmp_path / "y.png", tmp_path / "y.safetensors"
    lines = [{**REQUESTS[0], "save_result_path": str(mp4)},
             {**REQUESTS[0], "target_video_length": 1, "save_result_path": str(png), "save_tensor_path": str(png_tensor)}]
    rc, err = _cli(capsys, "--config_json", config_path, "--requests", _write_requests(tmp_path / "r.jsonl", lines))
    assert rc == 0, err
    expected = to_uint8_frames(isolated[0]).numpy()  # [F, H, W, 3] uint8

    # mp4: playable, 9 frames of 80x48, close to the tensor (H.264 is lossy).
    reader = imageio_ffmpeg.read_frames(str(mp4))
    meta = next(reader)
    assert tuple(meta["size"]) == (W, H)
    frames = [bytes(f) for f in reader]
    assert len(frames) == F
    assert imageio_ffmpeg.count_frames_and_secs(str(mp4))[0] == F
    first = torch.frombuffer(bytearray(frames[0]), dtype=torch.uint8).reshape(H, W, 3)
    assert first.shape == (H, W, 3)
    err_mean = (first.float() - torch.from_numpy(expected[0]).float()).abs().mean().item()
    assert err_mean < 25, f"mp4 frame 0 far from the tensor (mean abs error {err_mean:.1f} of 255)"

    # png: a one-frame request, lossless.
    image = iio.imread(png)
    assert image.shape == (H, W, 3) and image.dtype.name == "uint8"
    assert (image == to_uint8_frames(_video(png_tensor)).numpy()[0]).all()

    # Sidecars: the request's own seed, prompt and shape, and the resolved runner config without
    # the request defaults (seed 42, 9 frames) that this request replaced.
    for media, frames in ((mp4, F), (png, 1)):
        side = json.loads(media.with_suffix(".json").read_text())
        assert side["seed"] == REQUESTS[0]["seed"] and side["prompt"] == REQUESTS[0]["prompt"]
        assert (side["height"], side["width"], side["frames"]) == (H, W, frames)
        cfg = side["config"]
        assert cfg["model_cls"] == "wan2.1" and cfg["infer_steps"] == STEPS
        assert cfg["model_path"] == str(tiny_ckpt)
        assert not {"seed", "target_height", "target_width", "target_video_length", "negative_prompt"} & set(cfg)
        assert cfg["model"]["transformer"]["num_layers"] == 2  # resolved from the checkpoint


# ---- profile report -------------------------------------------------------------------------------
def _check_request_profile(entry: dict[str, Any], index: int, shape: list[int]) -> None:
    assert entry["index"] == index
    assert entry["shape"] == shape
    assert entry["seconds"] > 0
    stages = entry["stage_seconds"]
    assert list(stages) == ["text_encoder", "transformer", "vae_decoder", "save"]  # the t2v pipeline's stages
    for name in ("text_encoder", "transformer", "vae_decoder", "save"):
        assert stages[name] > 0, f"stage {name} not timed"
    assert sum(stages.values()) <= entry["seconds"] + 1e-6
    assert len(entry["step_seconds"]) == STEPS and all(s > 0 for s in entry["step_seconds"])
    assert sum(entry["step_seconds"]) <= stages["transformer"] + 1e-6
    memory = entry["memory"]  # CPU run: host memory, and no device-memory zeros
    assert set(memory) == {"host_rss_gib", "host_peak_rss_gib", "host_peak_scope", "host_anon_shmem_gib"}, memory
    assert 0 < memory["host_anon_shmem_gib"] <= memory["host_rss_gib"] <= memory["host_peak_rss_gib"] < 64
    assert memory["host_peak_scope"] in ("request", "process")
    assert set(entry["audit"]) >= {"compilations", "recompilations", "reserved_growth_gib", "warmed_shape"}
    assert entry["audit"]["compilations"] == 0 and entry["audit"]["recompilations"] == 0  # compile is off


CUDA_ONLY_KEYS = {f"requests[].memory.{k}" for k in ("allocated_gib", "reserved_gib", "peak_allocated_gib")}
FAMILY_ONLY_KEYS = {"warmup.frame_counts"}  # LTX-2.5's sweep (test_cases/models/ltx2/test_count_sweep.py)


def _documented_keys() -> set[str]:
    """The key paths of the table in docs/profile.md (first column, in backticks)."""
    import re

    text = (REPO / "docs" / "profile.md").read_text()
    return set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.M))


def _key_paths(report: dict[str, Any]) -> set[str]:
    """Key paths of a report, as docs/profile.md writes them (names inside stage/step maps excluded)."""
    paths = set(report)
    paths |= {f"phases.{k}" for k in report["phases"]}
    paths |= {f"attention.{k}" for k in report["attention"] or {}}
    paths |= {f"compile_cache.{k}" for k in report["compile_cache"] or {}}
    if report["warmup"] is not None:
        paths |= {f"warmup.{k}" for k in report["warmup"]}
    for entry in report["requests"]:
        paths |= {f"requests[].{k}" for k in entry}
        paths |= {f"requests[].{part}.{k}" for part in ("memory", "audit", "write") for k in entry[part]}
    return paths


def test_profile_json_without_warmup(config_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [REQUESTS[0], REQUESTS[1]]
    prof = tmp_path / "prof" / "p.json"
    rc, err = _cli(capsys, "--config_json", config_path, "--requests", _write_requests(tmp_path / "r.jsonl", lines),
                   "--profile_json", prof)
    assert rc == 0, err
    report = json.loads(prof.read_text())
    assert report["warmup"] is None
    assert len(report["requests"]) == 2
    _check_request_profile(report["requests"][0], 0, [H, W, F])
    _check_request_profile(report["requests"][1], 1, [32, 32, 5])
    assert [r["audit"]["warmed_shape"] for r in report["requests"]] == [False, False]


def test_profile_json_with_warmup_and_same_output(config_path: Path, isolated: list[torch.Tensor], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "w.safetensors"
    prof = tmp_path / "p.json"
    rc, err = _cli(capsys, "--config_json", config_path, *_flags(REQUESTS[0]), "--save_tensor_path", out,
                   "--warmup", "--profile_json", prof)
    assert rc == 0, err
    report = json.loads(prof.read_text())
    warm = report["warmup"]
    assert warm is not None
    assert set(warm) >= {"seconds", "shapes", "steps_per_shape", "memory_before", "memory_after"}
    assert warm["shapes"] == [[32, 32, 5], [H, W, F]]
    assert warm["steps_per_shape"] == {"transformer": [0]}  # per denoise stage
    assert warm["seconds"] > 0
    [entry] = report["requests"]
    _check_request_profile(entry, 0, [H, W, F])
    assert entry["audit"]["warmed_shape"] is True
    assert report["schema_version"] == 2 and report["device"] == "cpu"
    # docs/profile.md lists exactly these (the compile_cache section's keys: test_compile_cache.py; the
    # memory_plan section's: test_plan_infer.py)
    assert _key_paths(report) == {k for k in _documented_keys() - CUDA_ONLY_KEYS - FAMILY_ONLY_KEYS
                                  if not k.startswith(("compile_cache.", "memory_plan."))}
    # Same seed => same output with or without warmup (bit-identical on the CPU).
    assert torch.equal(_video(out), isolated[0])


# ---- invalid input ---------------------------------------------------------------------------------
def _assert_invalid(rc: int, err: str, *needles: str, code: int = 2) -> None:
    assert rc == code, err
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in:\n{err}"


@pytest.mark.parametrize(("overrides", "needles"), [
    ({"foo": 1}, ["foo: unknown field; allowed here: model_cls, task,"]),
    ({"offlaod": {"mode": "block"}}, ["offlaod: unknown field; did you mean `offload`?"]),
    ({"offload": {"mdoe": "block"}}, ["offload.mdoe: unknown field; did you mean `mode`? (got 'block')"]),
    ({"infer_steps": "four"}, ["infer_steps", "valid integer", "'four'"]),
    ({"infer_steps": 0}, ["infer_steps", "greater than or equal to 1", "got 0"]),
    ({"offload": {"gpu_slots": 1}}, ["offload.gpu_slots", "greater than or equal to 2", "got 1"]),
    ({"model_cls": "wan9"}, ["model_cls", "'wan9'", "wan2.1"]),
    ({"task": "x2v"}, ["task", "'x2v'", "allowed: ['t2v', 'i2v', 'flf2v']"]),
    ({"dtype": "fp64"}, ["dtype", "float32", "bfloat16", "'fp64'"]),
], ids=["unknown_key", "misspelled_key", "misspelled_nested_key", "wrong_type", "steps_0", "gpu_slots_1",
        "unknown_model_cls", "unknown_task", "bad_dtype"])
def test_invalid_config_values(tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               overrides: dict[str, Any], needles: list[str]) -> None:
    cfg = write_config(tmp_path / "c.json", tiny_config_dict(tiny_ckpt, **overrides))
    out = tmp_path / "o.safetensors"
    rc, err = _cli(capsys, "--config_json", cfg, "--prompt", "x", "--save_tensor_path", out)
    _assert_invalid(rc, err, "invalid input", *needles)
    assert not out.exists()


@pytest.mark.parametrize(("flags", "needles"), [
    (["--target_video_length", "8"], ["target_video_length", "4n+1", "got 8"]),
    (["--target_height", "40"], ["target_height", "multiple of 16", "got 40"]),
    (["--target_width", "81"], ["target_width", "multiple of 16", "got 81"]),
    (["--seed", "-1"], ["seed", "greater than or equal to 0"]),
    (["--save_result_path", "x.gif"], ["save_result_path", ".mp4", ".png", "x.gif"]),
    (["--save_result_path", "x.avi"],  # the suffixes of the task's output (Wan t2v: video), not of every writer
     ["invalid input: request on command line: `save_result_path` 'x.avi': task 't2v' makes a 9-frame video; "
      "use .mp4 (.png: with target_video_length 1)\n"]),
    (["--save_tensor_path", "x.pt"], ["save_tensor_path", ".safetensors", "x.pt"]),
], ids=["frames_8", "height_40", "width_81", "seed_neg", "media_suffix", "task_suffix", "tensor_suffix"])
def test_invalid_request_flags(config_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                               needles: list[str]) -> None:
    rc, err = _cli(capsys, "--config_json", config_path, "--prompt", "x", *flags)
    _assert_invalid(rc, err, *needles)


def test_missing_checkpoint_folder(tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no_such_ckpt"
    cfg = write_config(tmp_path / "c.json", tiny_config_dict(tiny_ckpt, model_path=str(missing)))
    rc, err = _cli(capsys, "--config_json", cfg, "--prompt", "x")
    _assert_invalid(rc, err, "load failed", str(missing), "does not exist", "synthetic_checkpoint")
    assert not missing.exists()  # never written without synthetic_checkpoint


def test_checkpoint_missing_tensor_is_named(tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_ckpt, broken)
    files = sorted((broken / "transformer").glob("*.safetensors"))
    assert len(files) == 1, files  # the tiny transformer fits one shard
    sd = load_file(str(files[0]))
    dropped = "blocks.1.ffn.0.weight"
    del sd[dropped]
    save_file(sd, str(files[0]))
    cfg = write_config(tmp_path / "c.json", tiny_config_dict(broken))
    out = tmp_path / "o.safetensors"
    rc, err = _cli(capsys, "--config_json", cfg, "--prompt", "x", "--save_tensor_path", out)
    _assert_invalid(rc, err, "load failed", "transformer", "missing keys (1)", dropped)
    assert not out.exists()


@pytest.mark.parametrize("warmup", [False, True])
def test_nan_weights_fail_the_request_before_decoding(tiny_ckpt: Path, tmp_path: Path, warmup: bool,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A NaN in the transformer's output head makes every latent NaN: the run fails (at warmup when it
    runs, else at the request) naming the count, and saves nothing (it used to save noise, exit 0)."""
    broken = tmp_path / "nan"
    shutil.copytree(tiny_ckpt, broken)
    (shard,) = (broken / "transformer").glob("*.safetensors")
    sd = load_file(str(shard))
    sd["head.head.bias"][0] = float("nan")
    save_file(sd, str(shard))
    cfg = write_config(tmp_path / "c.json", tiny_config_dict(broken, warmup=warmup))
    out = tmp_path / "o.safetensors"
    rc, err = _cli(capsys, "--config_json", cfg, "--prompt", "x", "--save_tensor_path", out)
    assert rc == 1, err
    # warmup's first shape runs one step (the NaN bias reaches one latent channel); a request runs
    # four, and the solver mixes every channel
    phase, shape, count = (("warmup failed", "[1, 16, 2, 4, 4]", "8 non-finite values (NaN or Inf) of 512")
                           if warmup else
                           ("request 0 (command line) failed", "[1, 16, 3, 6, 10]", "2880 non-finite values (NaN or Inf) of 2880"))
    assert f"{phase}: FloatingPointError: the denoised latents {shape} hold {count}: " in err, err
    assert "nothing is decoded or saved" in err and "Traceback" not in err, err  # the one line says it all
    assert not out.exists()


def test_a_refused_config_names_the_flags_that_overrode_the_file(config_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The runner refuses `device: cuda` without CUDA: the message names the file and the flags that
    changed it (the value came from `--device`, not from the file)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, err = _cli(capsys, "--config_json", config_path, "--device", "cuda", "--infer_steps", 2, "--prompt", "x")
    _assert_invalid(rc, err, f"invalid input: config {config_path} with --infer_steps 2, --device 'cuda': "
                             "`device` is 'cuda' but CUDA is not available; use 'cpu' or 'auto'")


def test_unknown_model_cls_flag_is_rejected_by_argparse(config_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--config_json", str(config_path), "--model_cls", "wan9", "--prompt", "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--model_cls" in err and "'wan9'" in err and "wan2.1" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("which", ["infer", "serve"])
def test_an_abbreviated_flag_is_an_error_not_a_guess(which: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Fresh-eyes test: `--infer_step 3` (argparse's allow_abbrev) ran with 3 steps; `runnerkit serve
    --conf c.json` read --config_json. Both parsers refuse a prefix of a real flag."""
    from runnerkit.infer import build_parser as infer_parser
    from runnerkit.serve.server import build_parser as serve_parser

    parser, argv, flag = ((infer_parser(), ["--infer_step", "3", "--prompt", "x"], "--infer_step") if which == "infer" else
                          (serve_parser(), ["--config_json", "c.json", "--por", "9"], "--por"))
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(argv)
    assert exc.value.code == 2
    assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_prompt_and_requests_are_exclusive(config_path: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    reqs = _write_requests(tmp_path / "r.jsonl", [{"prompt": "a"}])
    rc, err = _cli(capsys, "--config_json", config_path, "--prompt", "x", "--requests", reqs)
    _assert_invalid(rc, err, "--requests", "--prompt")


def test_prompt_or_requests_required(config_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _cli(capsys, "--config_json", config_path)
    _assert_invalid(rc, err, "--prompt", "--requests")


def test_requests_line_with_unknown_key(config_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "first.safetensors"
    reqs = _write_requests(tmp_path / "r.jsonl", [{"prompt": "a", "save_tensor_path": str(out)},
                                                  {"prompt": "b", "bogus": 1}])
    rc, err = _cli(capsys, "--config_json", config_path, "--requests", reqs)
    _assert_invalid(rc, err, "line 2", "bogus: unknown field; allowed here: prompt,")
    assert not out.exists()  # every line is validated before anything runs


def test_requests_line_with_bad_shape(config_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "first.safetensors"
    reqs = _write_requests(tmp_path / "r.jsonl", [{"prompt": "a", "save_tensor_path": str(out)},
                                                  {"prompt": "b", "target_video_length": 6}])
    rc, err = _cli(capsys, "--config_json", config_path, "--requests", reqs)
    _assert_invalid(rc, err, "line 2", "target_video_length", "4n+1", "got 6")
    assert not out.exists()


def test_requests_file_reports_every_bad_line_at_once(config_path: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    reqs = _write_requests(tmp_path / "r.jsonl", [{"prompt": "a"}, {"prompt": "b", "target_video_length": 6},
                                                  {"prompt": "c"}, {"prompt": "d", "target_height": 50}])
    rc, err = _cli(capsys, "--config_json", config_path, "--requests", reqs)
    _assert_invalid(rc, err, "2 of 4 requests are invalid", "line 2", "got 6", "line 4", "got 50")


def test_requests_file_reports_every_malformed_line_at_once(config_path: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Lines that are not valid requests at all (unknown key, wrong type, not JSON) are all named."""
    reqs = tmp_path / "r.jsonl"
    reqs.write_text('{"prompt": "a"}\n{"prompt": "b", "bogus": 1}\n{"prompt": "c", "seed": "x"}\nnot json\n')
    rc, err = _cli(capsys, "--config_json", config_path, "--requests", reqs)
    _assert_invalid(rc, err, "3 of 4 request lines are invalid", "line 2", "bogus", "line 3", "seed", "line 4")


def test_requests_file_reports_malformed_and_refused_lines_in_one_report(config_path: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A line the runner refuses (a shape) is named beside the lines that are not requests at all, in line
    order and in one count, not in a second report once the others are fixed."""
    reqs = tmp_path / "r.jsonl"
    reqs.write_text('{"prompt": "a"}\n{"prompt": "b", "target_height": 33}\n{"prompt": "c", "bogus": 1}\n')
    rc, err = _cli(capsys, "--config_json", config_path, "--requests", reqs)
    _assert_invalid(rc, err, "2 of 3 request lines are invalid", "line 2", "multiple of 16 (got 33)", "line 3", "bogus")
    assert err.index("line 2") < err.index("line 3")


def test_config_file_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.json"
    rc, err = _cli(capsys, "--config_json", missing, "--prompt", "x")
    _assert_invalid(rc, err, str(missing), "does not exist")


def test_config_file_invalid_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_cls": "wan2.1",')
    rc, err = _cli(capsys, "--config_json", bad, "--prompt", "x")
    _assert_invalid(rc, err, str(bad), "not valid UTF-8 JSON")


def test_png_for_a_multi_frame_video_is_refused(config_path: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _cli(capsys, "--config_json", config_path, "--prompt", "x", "--save_result_path", tmp_path / "a.png")
    _assert_invalid(rc, err, "save_result_path", "9-frame video", ".mp4")


def test_output_under_a_file_is_refused_before_loading(config_path: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file")
    rc, err = _cli(capsys, "--config_json", config_path, "--prompt", "x", "--save_tensor_path", blocker / "o.safetensors")
    _assert_invalid(rc, err, "save_tensor_path", "is a file, not a folder")
    assert "load:" not in err and blocker.read_text() == "a regular file"


def test_two_requests_writing_one_file_are_refused(config_path: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    same = str(tmp_path / "same.safetensors")
    reqs = _write_requests(tmp_path / "r.jsonl", [{"prompt": "a", "save_tensor_path": same},
                                                  {"prompt": "b", "save_tensor_path": same}])
    rc, err = _cli(capsys, "--config_json", config_path, "--requests", reqs)
    _assert_invalid(rc, err, "line 2", "is also written by save_tensor_path of the request on line 1")


def test_image_path_on_text_to_video_is_refused(config_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _cli(capsys, "--config_json", config_path, "--prompt", "x", "--image_path", "/nonexistent.png")
    _assert_invalid(rc, err, "image_path", "not used by task 't2v'")


@pytest.mark.parametrize(("key", "value", "needle"), [("infer_steps", "4", "valid integer"),
                                                      ("infer_steps", True, "valid integer"),
                                                      ("enable_cfg", "yes", "valid boolean"),
                                                      ("boundary", 0.9, "MoE"),
                                                      ("offload", {"mode": "none", "gpu_slots": 3}, "no effect"),
                                                      ("sample_guide_scale", -5.0, "must be >= 0"),
                                                      ("model", {"transformer": {"num_heads": 3}},  # not the ckpt's
                                                       "`model.transformer.num_heads` 3 (the checkpoint's: 2)")])
def test_no_silent_coercion_or_ignored_settings(tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                key: str, value: Any, needle: str) -> None:
    cfg = write_config(tmp_path / "c.json", tiny_config_dict(tiny_ckpt, **{key: value}))
    rc, err = _cli(capsys, "--config_json", cfg, "--prompt", "x")
    _assert_invalid(rc, err, key, needle)


@pytest.mark.parametrize("overrides", [{"sample_guide_scale": 5.0}, {"negative_prompt": "blurry"}])
def test_cfg_settings_without_cfg_are_refused(tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              overrides: dict[str, Any]) -> None:
    [key] = overrides
    cfg = write_config(tmp_path / "c.json", tiny_config_dict(tiny_ckpt, enable_cfg=False,
                                                             **{"sample_guide_scale": None, **overrides}))
    rc, err = _cli(capsys, "--config_json", cfg, "--prompt", "x")
    _assert_invalid(rc, err, f"`{key}` only acts with classifier-free guidance", "`enable_cfg` is false")


def test_request_negative_prompt_without_cfg_is_refused(tiny_ckpt: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "c.json", tiny_config_dict(tiny_ckpt, enable_cfg=False, sample_guide_scale=None))
    rc, err = _cli(capsys, "--config_json", cfg, "--prompt", "x", "--negative_prompt", "blurry")
    _assert_invalid(rc, err, "`negative_prompt` only acts with classifier-free guidance")


def test_arch_error_is_refused_before_loading_and_names_the_config(tiny_ckpt: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    data = tiny_config_dict(tiny_ckpt)
    data["model"]["transformer"]["num_heads"] = 3  # dim 64: head size 64/3
    cfg = write_config(tmp_path / "c.json", data)
    rc, err = _cli(capsys, "--config_json", cfg, "--prompt", "x")
    _assert_invalid(rc, err, f"invalid input: config {cfg}:", "model.transformer: `dim`=64")
    assert "load" not in err  # refused before anything loaded


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("flag", ["--save_result_path", "--profile_json"])
def test_outputs_on_an_unwritable_file_system_are_refused_before_loading(config_path: Path, flag: str,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """/proc accepts no new files, even for root (whom permission bits let through)."""
    path = "/proc/x.mp4" if flag == "--save_result_path" else "/proc/profile.json"
    rc, err = _cli(capsys, "--config_json", config_path, "--prompt", "x", flag, path)
    # not "is not writable": root may write /proc's files, but no new file can be made there
    _assert_invalid(rc, err, f"{path!r} cannot be created in '/proc': that folder cannot hold new files "
                    "(No such file or directory)")
    assert "load:" not in err


def test_an_output_folder_without_write_permission_is_called_not_writable(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """EACCES / EROFS keep "is not writable" (a read-only mount, a folder of another user)."""
    import errno

    from runnerkit.cli_common import check_writable
    from runnerkit.config import ConfigError

    def refuse(self: Path, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "touch", refuse)
    with pytest.raises(ConfigError, match=re.escape(f"cannot be created: {str(tmp_path)!r} is not writable "
                                                    "(Read-only file system)")):
        check_writable(str(tmp_path / "o.mp4"), "save_result_path")


def _synthetic_config(tmp_path: Path) -> Path:
    """The tiny config as shipped (`synthetic_checkpoint`, no `model_path`: the cache is used), on the CPU."""
    from test_cases.conftest import TINY_CONFIG

    data = json.loads(TINY_CONFIG.read_text())
    data["device"] = "cpu"
    return write_config(tmp_path / "synthetic.json", data)


def test_a_cache_variable_naming_a_file_is_refused_before_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Fresh-eyes test: RUNNERKIT_CACHE=/some/file failed at load with a NotADirectoryError naming a
    `.partial-...` temporary folder, neither the variable nor the fix."""
    cache = tmp_path / "cache_file"
    cache.write_text("not a folder")
    monkeypatch.setenv("RUNNERKIT_CACHE", str(cache))
    rc, err = _cli(capsys, "--config_json", _synthetic_config(tmp_path), "--prompt", "x")
    _assert_invalid(rc, err, f"invalid input: `RUNNERKIT_CACHE` {str(cache)!r} must be a writable folder (synthetic "
                    f"checkpoints are written under it): {str(cache)!r} is a file\n")
    assert "load" not in err and ".partial-" not in err


def test_a_damaged_cached_synthetic_checkpoint_names_the_folder_to_delete(tiny_ckpt: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A truncated file of a synthetic checkpoint in the cache: the error names the file and says to
    delete the checkpoint's folder (rewritten on the next run). A user's checkpoint gets no such hint
    (test_damaged_checkpoints.py)."""
    from runnerkit.config import load_runner_config
    from runnerkit.registry import get_runner_cls

    monkeypatch.setenv("RUNNERKIT_CACHE", str(tmp_path / "cache"))
    cfg = _synthetic_config(tmp_path)
    config = load_runner_config(str(cfg), {})
    folder = get_runner_cls(config.model_cls, config.task)(config).checkpoints.path()
    assert folder.is_relative_to(tmp_path / "cache")
    shutil.copytree(tiny_ckpt, folder)  # the same architecture, seed 0, float32: what the run would write
    (damaged,) = (folder / "transformer").glob("*.safetensors")
    with open(damaged, "r+b") as f:
        f.truncate(damaged.stat().st_size // 2)
    rc, err = _cli(capsys, "--config_json", cfg, "--prompt", "x")
    _assert_invalid(rc, err, "load failed: CheckpointError:", str(damaged),
                    f"; {folder} is a synthetic checkpoint: delete that folder and run again to write it anew\n")


def test_python_api_takes_a_request_dict(tiny_config: Any, tmp_path: Path) -> None:
    from runnerkit.config import ConfigError, RequestConfig
    from runnerkit.registry import get_runner_cls

    runner = get_runner_cls(tiny_config.model_cls)(tiny_config.model_copy(update={"infer_steps": 1}))
    runner.init_modules()
    as_dict = {"prompt": "a fox", "seed": 3, "save_tensor_path": str(tmp_path / "d.safetensors")}
    runner.run_pipeline(as_dict)
    runner.run_pipeline(RequestConfig(**{**as_dict, "save_tensor_path": str(tmp_path / "r.safetensors")}), 1)
    assert torch.equal(load_file(tmp_path / "d.safetensors")["video"], load_file(tmp_path / "r.safetensors")["video"])
    with pytest.raises(ConfigError, match="seed"):
        runner.run_pipeline({"prompt": "a fox", "seed": -1}, 2)
    with pytest.raises(TypeError, match="a request must be a RequestConfig or a dict"):
        runner.run_pipeline("a fox", 3)


# ---- warmup gate ---------------------------------------------------------------------------------
def test_warmup_with_unload_modules_refused_before_any_request(tiny_ckpt: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "c.json", tiny_config_dict(tiny_ckpt, unload_modules=True))
    out, prof = tmp_path / "o.safetensors", tmp_path / "p.json"
    rc, err = _cli(capsys, "--config_json", cfg, "--prompt", "x", "--save_tensor_path", out, "--warmup",
                   "--profile_json", prof)
    assert rc != 0
    _assert_invalid(rc, err, "unload_modules", "NotImplementedError")
    assert "step 1/" not in err  # no denoising step ran
    assert not out.exists() and not prof.exists()


def test_sidecar_and_profile_collisions_are_refused(config_path: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _cli(capsys, "--config_json", config_path, "--prompt", "x", "--save_result_path", tmp_path / "pc.mp4",
                   "--profile_json", tmp_path / "pc.json")
    _assert_invalid(rc, err, "sidecar .json of save_result_path", "--profile_json")
    same = tmp_path / "d.safetensors"
    reqs = _write_requests(tmp_path / "r.jsonl", [{"prompt": "a", "save_tensor_path": str(same)},
                                                  {"prompt": "b", "save_tensor_path": f"{tmp_path}/../{tmp_path.name}/d.safetensors"}])
    rc, err = _cli(capsys, "--config_json", config_path, "--requests", reqs)
    _assert_invalid(rc, err, "line 2", "is also written by")


@pytest.mark.parametrize("content", ['{"format": "runnerkit", "family": "wan2.1"}', "[]",
                                     '{"family": "wan2.1", "arch": {"transformer": {"dim": "64"}}}'])
def test_bad_runnerkit_json_is_a_load_error(tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            content: str) -> None:
    broken = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, broken)
    (broken / "runnerkit.json").write_text(content)
    cfg = write_config(tmp_path / "c.json", tiny_config_dict(broken))
    rc, err = _cli(capsys, "--config_json", cfg, "--prompt", "x", "--warmup")
    _assert_invalid(rc, err, "load failed: CheckpointError", "runnerkit.json")


# ---- inputs are never overwritten; config problems blame the config --------------------------------
def test_outputs_may_not_overwrite_the_config_or_requests_file(tiny_ckpt: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "job.json", tiny_config_dict(tiny_ckpt))
    before = cfg.read_text()
    rc, err = _cli(capsys, "--config_json", cfg, "--prompt", "x", "--save_result_path", tmp_path / "job.mp4")
    assert rc == 2 and "would overwrite the --config_json input file" in err, err
    reqs = _write_requests(tmp_path / "reqs.jsonl", [{"prompt": "x", "save_tensor_path": str(tmp_path / "t.safetensors")}])
    rc, err = _cli(capsys, "--config_json", cfg, "--requests", reqs, "--profile_json", reqs)
    assert rc == 2 and "would overwrite the --requests input file" in err, err
    assert cfg.read_text() == before and not (tmp_path / "job.mp4").exists()


def test_bad_default_shape_in_config_names_the_config(tiny_ckpt: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "c.json", tiny_config_dict(tiny_ckpt, target_height=50))
    rc, err = _cli(capsys, "--config_json", cfg, "--prompt", "x")
    assert rc == 2 and f"config {cfg}: `target_height` must be a multiple of 16 (got 50)" in err, err


# ---- failed writes ------------------------------------------------------------------------------
def test_failed_writes_fail_the_request_name_the_file_and_leave_nothing(config_path: Path, tmp_path: Path) -> None:
    """Under a 16 KiB file-size limit the mp4 (~30 KiB) and the tensor file (~400 KiB) cannot be
    written; a one-frame png (~3 KiB) can. The failed requests exit 1 naming their final paths."""
    import resource
    import subprocess
    import sys

    mp4, tensor, png = tmp_path / "v.mp4", tmp_path / "t.safetensors", tmp_path / "i.png"
    reqs = _write_requests(tmp_path / "reqs.jsonl", [
        {"prompt": "a", "save_result_path": str(mp4)},
        {"prompt": "b", "save_tensor_path": str(tensor)},
        {"prompt": "c", "target_height": 32, "target_width": 32, "target_video_length": 1, "save_result_path": str(png)}])
    limit = 16 * 1024
    proc = subprocess.run([sys.executable, "-m", "runnerkit.infer", "--config_json", str(config_path), "--requests",
                           str(reqs)], capture_output=True, text=True, cwd=REPO, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    err = proc.stderr
    assert proc.returncode == 1, err
    assert f"could not write `save_result_path` {str(mp4)!r}: the encoder was killed by SIGXFSZ" in err, err
    assert f"could not write `save_tensor_path` {str(tensor)!r}: File too large" in err, err
    assert "2 of 3 requests failed: [0, 1]" in err and "partial" not in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["i.json", "i.png", "reqs.jsonl"]  # no partial, no sidecar


def test_full_file_system_fails_the_request_and_removes_partial_files(config_path: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A full disk, faked: an encoder that writes part of its file and fails with ENOSPC as ffmpeg
    does, and a tensor writer that raises ENOSPC after writing part of its file."""
    import errno

    import imageio_ffmpeg

    from runnerkit import media

    encoder = tmp_path / "bin" / "ffmpeg"
    encoder.parent.mkdir()
    encoder.write_text('#!/bin/sh\nfor last; do :; done\nhead -c 1000 /dev/zero > "$last"\n'
                       'echo "av_interleaved_write_frame(): No space left on device" >&2\nexit 1\n')
    encoder.chmod(0o755)
    monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", lambda: str(encoder))

    def full_disk(tensors: Any, path: str) -> None:
        Path(path).write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(media, "save_file", full_disk)
    out = tmp_path / "out"
    reqs = _write_requests(tmp_path / "reqs.jsonl", [{"prompt": "a", "save_result_path": str(out / "v.mp4")},
                                                     {"prompt": "b", "save_tensor_path": str(out / "t.safetensors")}])
    rc, err = _cli(capsys, "--config_json", config_path, "--requests", reqs, "--infer_steps", "1")
    assert rc == 1, err
    assert (f"could not write `save_result_path` {str(out / 'v.mp4')!r}: the encoder exited with status 1: "
            "av_interleaved_write_frame(): No space left on device; nothing was saved") in err, err
    assert f"could not write `save_tensor_path` {str(out / 't.safetensors')!r}: No space left on device" in err, err
    assert "2 of 2 requests failed" in err and "saved" not in err.replace("nothing was saved", "")
    assert list(out.iterdir()) == []  # no partial file, no sidecar


# ---- signals ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("sig", "status", "name"), [(15, 143, "SIGTERM"), (2, 130, "Ctrl-C")])
def test_signal_mid_batch_keeps_finished_outputs_and_removes_partial_ones(config_path: Path, tmp_path: Path,
                                                                          sig: int, status: int, name: str) -> None:
    """SIGTERM is handled like Ctrl-C: nothing more runs, finished outputs stay, no partial file."""
    import subprocess
    import sys

    outs = [tmp_path / f"r{i}.safetensors" for i in range(3)]
    reqs = _write_requests(tmp_path / "reqs.jsonl", [{**r, "save_tensor_path": str(p)} for r, p in zip(REQUESTS, outs)])
    proc = subprocess.Popen([sys.executable, "-m", "runnerkit.infer", "--config_json", str(config_path), "--requests",
                             str(reqs), "--profile_json", str(tmp_path / "profile.json")],
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    lines = []
    for line in proc.stderr:  # signal right after request 0 is saved
        lines.append(line)
        if f"saved {outs[0]}" in line:
            proc.send_signal(sig)
            break
    err = "".join(lines) + proc.stderr.read()
    assert proc.wait(timeout=120) == status, err
    finished = [p for p in outs if p.exists()]
    # the signal lands between requests or inside one (its phase named, e.g. "request 1 (denoise)" or "request 0 (end_run)")
    assert re.search(rf"interrupted \({name}( during request \d( \(\w+\))?)?\); {len(finished)} of 3 requests finished",
                     err), err
    assert outs[0] in finished and len(finished) < 3 and "Traceback" not in err
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]
    assert json.loads((tmp_path / "profile.json").read_text())["requests"][0]["saved"] is True


def test_interrupted_synthetic_write_leaves_no_partial_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from runnerkit.interrupts import Terminated
    from runnerkit.tools.synth_checkpoint import main as synth_main

    calls = []

    def interrupted(*a: Any, **k: Any) -> None:
        calls.append(1)
        if len(calls) == 2:  # the second component: something is already written
            raise Terminated("SIGTERM")
        real(*a, **k)

    real = synthetic.write_sharded
    monkeypatch.setattr(synthetic, "write_sharded", interrupted)
    assert synth_main(["--config", str(REPO / "configs/wan/wan_t2v_tiny.json"), "--out", str(tmp_path / "ck"),
                       "--dtype", "fp32"]) == 143
    assert list(tmp_path.iterdir()) == []


def test_infer_steps_device_and_log_level_flags(config_path: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "p.json"
    rc, err = _cli(capsys, "--config_json", config_path, "--prompt", "x", "--infer_steps", "2", "--device", "cpu",
                   "--log_level", "WARNING", "--profile_json", profile)
    assert rc == 0, err
    assert len(json.loads(profile.read_text())["requests"][0]["step_seconds"]) == 2
    assert "| INFO" not in err and "| WARNING" in err  # the synthetic-weights warning still shows
    rc, err = _cli(capsys, "--config_json", config_path, "--prompt", "x", "--infer_steps", "0")
    assert rc == 2 and "infer_steps" in err


# ---- file permissions and the launcher script ---------------------------------------------------
def test_every_output_file_gets_the_umask_mode(config_path: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The safetensors writer creates 0o600 files; runnerkit gives them the mode every other output gets."""
    from runnerkit.models.wan.arch import WanArch
    from runnerkit.models.wan.checkpoint import write_synthetic

    old = os.umask(0o027)
    try:
        rc, err = _cli(capsys, "--config_json", config_path, "--prompt", "x", "--infer_steps", "1",
                       "--save_result_path", tmp_path / "v.mp4", "--save_tensor_path", tmp_path / "v.safetensors",
                       "--profile_json", tmp_path / "p.json")
        data = json.loads((REPO / "configs/wan/wan_t2v_tiny.json").read_text())
        write_synthetic(WanArch.model_validate(data["model"]), tmp_path / "ck", seed=0, dtype=torch.float32)
    finally:
        os.umask(old)
    assert rc == 0, err
    modes = {p.relative_to(tmp_path).as_posix(): oct(p.stat().st_mode & 0o777) for p in tmp_path.rglob("*") if p.is_file()}
    assert "v.safetensors" in modes and "ck/transformer/model.safetensors" in modes
    assert set(modes.values()) == {oct(0o640)}, modes


def test_wan_t2v_script_accepts_a_requests_file(config_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = _write_requests(tmp_path / "reqs.jsonl", [
        {"prompt": "a", "seed": 1, "save_tensor_path": str(tmp_path / "a.safetensors")},
        {"prompt": "b", "seed": 2, "save_tensor_path": str(tmp_path / "b.safetensors")}])
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(REPO), "OUT": str(tmp_path / "default.mp4")}
    rc, err = run_launch_script(capsys, monkeypatch, REPO / "scripts/wan/run_wan_t2v.sh",
                                [str(config_path), "--requests", str(reqs), "--infer_steps", "1"], tmp_path, env)
    assert rc == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors", "reqs.jsonl"]
    assert "warmup:" in err  # the script warms up


def test_wan_t2v_script_with_a_prompt_still_saves_to_out(config_path: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """--prompt replaces only the default prompt: the result still goes to $OUT."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(REPO), "OUT": str(tmp_path / "out.mp4")}
    rc, err = run_launch_script(capsys, monkeypatch, REPO / "scripts/wan/run_wan_t2v.sh",
                                [str(config_path), "--prompt", "a cat", "--infer_steps", "1"], tmp_path, env)
    assert rc == 0, err
    assert (tmp_path / "out.mp4").stat().st_size > 0 and (tmp_path / "out.json").is_file()


# ---- memory refusal (planning/fit.py, models/wan/estimate.py) ---------------------------------------
HUGE = ("--target_height", 4096, "--target_width", 4096)


def _peak(config: dict[str, Any], shape: tuple[int, int, int]) -> Any:
    from runnerkit.config import load_runner_config
    from runnerkit.models.wan.runner import WanT2VRunner
    from runnerkit.planning.fit import peak_of

    runner = WanT2VRunner(load_runner_config(None, config))
    return peak_of(runner.estimate_memory(shape), runner.config, runner.device)


def test_4096_frames_on_a_16_gib_limit_exit_2_in_seconds_before_loading(tiny_ckpt: Path, tmp_path: Path, mocker: Any,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 8 item 5's example: 4096x4096 frames with the tiny config are refused before anything
    loads (accepted before, then still on step 1 after minutes), with the estimate and the limit."""
    import time

    from runnerkit.models.wan.runner import WanT2VRunner

    data = tiny_config_dict(tiny_ckpt, memory={"limit_gib": 16.0})
    cfg = write_config(tmp_path / "c.json", data)
    out = tmp_path / "x.safetensors"
    load = mocker.spy(WanT2VRunner, "load_modules")
    t0 = time.perf_counter()
    rc, err = _cli(capsys, "--config_json", cfg, "--prompt", "a cat", *HUGE, "--save_tensor_path", out)
    assert rc == 2 and time.perf_counter() - t0 < 10, err
    assert load.call_count == 0 and "step 1/" not in err and not out.exists()
    peak = _peak(data, (4096, 4096, 9))
    assert peak.bytes > 16 * 1024**3 and peak.stage == "vae_decoder"
    _assert_invalid(rc, err, "invalid input: request 0 (command line): shape 4096x4096x9 (height x width x frames) "
                             f"needs an estimated {peak.bytes / 1024**3:.2f} GiB (peak in stage vae_decoder",
                    "on cpu, more than the limit of 16.00 GiB (config memory.limit_gib)",
                    "offload.vae_tiling=true", "smaller target_height/target_width/target_video_length")


def test_4096_frames_are_refused_against_this_machines_memory(tiny_ckpt: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The same request with the limit read from the host (MemAvailable, cgroup), unless this machine
    really has the memory the estimate asks for."""
    data = tiny_config_dict(tiny_ckpt)
    peak = _peak(data, (4096, 4096, 9))
    available = memory.host_available_bytes()
    if available is None or available[0] >= peak.bytes:
        pytest.skip(f"this machine has {available} bytes available, enough for the {peak.bytes} estimated")
    rc, err = _cli(capsys, "--config_json", write_config(tmp_path / "c.json", data), "--prompt", "a cat", *HUGE)
    _assert_invalid(rc, err, "shape 4096x4096x9", "GiB available (MemAvailable")


def test_a_request_line_that_cannot_fit_stops_the_batch_before_loading(config_path: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    outs = [tmp_path / f"{i}.safetensors" for i in range(3)]
    reqs = _write_requests(tmp_path / "r.jsonl", [
        {"prompt": "fits", "save_tensor_path": str(outs[0])},
        {"prompt": "does not", "target_height": 4096, "target_width": 4096, "save_tensor_path": str(outs[1])},
        {"prompt": "fits too", "save_tensor_path": str(outs[2])}])
    data = {**json.loads(config_path.read_text()), "memory": {"limit_gib": 8.0}}
    rc, err = _cli(capsys, "--config_json", write_config(tmp_path / "c.json", data), "--requests", reqs)
    _assert_invalid(rc, err, f"request 1 (line 2 of {str(reqs)!r}): shape 4096x4096x9", "limit of 8.00 GiB")
    assert "load:" not in err and not any(p.exists() for p in outs)


def test_requests_that_fit_run_and_warmup_shapes_are_checked(tiny_ckpt: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """With a limit between the two warmup shapes' estimates, a small request fits but --warmup is
    refused (phase warmup, exit 2, before loading); without --warmup it runs."""
    from runnerkit.models.wan.runner import WanT2VRunner

    small, production = WanT2VRunner.WARMUP_SHAPES["debug"]
    base = tiny_config_dict(tiny_ckpt)
    lo, hi = _peak(base, small).bytes, _peak(base, production).bytes
    assert lo < hi
    data = tiny_config_dict(tiny_ckpt, memory={"limit_gib": (lo + hi) / 2 / 1024**3})
    cfg = write_config(tmp_path / "c.json", data)
    h, w, f = small
    flags = ["--prompt", "a cat", "--target_height", h, "--target_width", w, "--target_video_length", f]
    out = tmp_path / "ok.safetensors"
    rc, err = _cli(capsys, "--config_json", cfg, *flags, "--warmup", "--save_tensor_path", out)
    _assert_invalid(rc, err, f"warmup failed: MemoryFitError: warmup shape {list(production)}")
    assert "load:" not in err and not out.exists()
    rc, err = _cli(capsys, "--config_json", cfg, *flags, "--save_tensor_path", out)
    assert rc == 0 and out.is_file(), err


# ---- fresh-eyes findings: full disks for synthetic weights and the profile --------------------------
def test_synthetic_checkpoint_on_a_full_disk_names_the_folder_and_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The safetensors writer failing with the OS's ENOSPC (faked after the first shard) is an
    input-side failure naming the checkpoint folder, and leaves no partial folder."""
    from safetensors import SafetensorError

    real = synthetic.save_file
    calls = []

    def full_disk(tensors: Any, path: str) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        real(tensors, path)

    monkeypatch.setattr(synthetic, "save_file", full_disk)
    data = json.loads((REPO / "configs/wan/wan_t2v_tiny.json").read_text())
    data.update(model_path=str(tmp_path / "ck"), device="cpu")
    rc, err = _cli(capsys, "--config_json", write_config(tmp_path / "c.json", data), "--prompt", "x")
    assert rc == 2, err
    assert f"cannot write a synthetic checkpoint to {tmp_path / 'ck'}: No space left on device; nothing was written" in err
    assert "Traceback" not in err and sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]


def test_profile_is_written_atomically(config_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A failing profile write keeps the older report and leaves no truncated or partial file."""
    import errno

    profile = tmp_path / "p.json"
    profile.write_text('{"older": "report"}')
    real_write_text = Path.write_text

    def full_disk(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        if self.name.startswith(".p.json.partial"):
            real_write_text(self, data[:10])  # part of it reached the disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    rc, err = _cli(capsys, "--config_json", config_path, "--prompt", "x", "--infer_steps", "1", "--profile_json", profile)
    assert rc == 1 and "could not write --profile_json" in err and "No space left on device" in err, err
    assert profile.read_text() == '{"older": "report"}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


# ---- issue 19: arguments before heavy imports; the media extra checked before loading -----------------
_PARSE_ONLY = """
import sys
from runnerkit.infer import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in ("torch", "pydantic", "numpy", "safetensors") if m in sys.modules)
print("RESULT", code, ",".join(heavy) or "-")
"""


@pytest.mark.parametrize(("argv", "code", "needle"), [
    (["--bogus"], 2, "unrecognized arguments: --bogus"),
    (["--help"], 0, "{ltx2,ltx2.5,qwen_image,wan2.1,wan2.2_moe}"),
    (["--model_cls", "wan9", "--prompt", "x"], 2, "invalid choice: 'wan9' (choose from"),
    (["--infer_step", "3", "--prompt", "x"], 2, "unrecognized arguments: --infer_step 3"),
], ids=["typo", "help", "unknown_model_cls", "abbreviation"])
def test_a_flag_typo_or_help_answers_without_importing_torch(argv: list[str], code: int, needle: str) -> None:
    """Issue 19: a typo took 5.5 s (17-25 s under load) to report: the families (and torch) were
    imported to list `--model_cls` choices before parsing. Checked by what the process imported,
    not by a clock."""
    proc = subprocess.run([sys.executable, "-c", _PARSE_ONLY, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert result == [f"RESULT {code} -"], proc.stdout + proc.stderr
    assert needle in proc.stdout + proc.stderr.replace("\n", " ")
    assert "Traceback" not in proc.stderr


def test_without_the_media_extra_an_mp4_request_exits_2_before_loading(
        config_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 19: without `imageio_ffmpeg` a run computed everything, then failed at save with a
    77-line traceback (exit 1). Now one line with the pip command, before loading. The module is
    hidden (`sys.modules[name] = None` makes its import fail, also where it was imported before),
    and loading raises: the refusal must come first."""
    from runnerkit.runners.default import DefaultRunner

    def no_load(self: Any) -> None:
        raise AssertionError("loaded")

    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    monkeypatch.setattr(DefaultRunner, "load_modules", no_load)
    out = tmp_path / "cat.mp4"
    rc, err = _cli(capsys, "--config_json", config_path, "--prompt", "a cat", "--save_result_path", out)
    assert rc == 2, err
    lines = [line for line in err.splitlines() if "| ERROR" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].endswith(
        f"invalid input: `save_result_path` {str(out)!r} (request on command line) needs the `media` extra: "
        "pip install \"runnerkit[media]\" (from a checkout: pip install -e \".[media]\"); missing: imageio_ffmpeg")
    assert not out.exists()


def test_without_imageio_a_png_request_is_refused_and_a_tensor_only_request_runs(
        config_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "imageio", None)
    monkeypatch.setitem(sys.modules, "imageio.v3", None)
    png = tmp_path / "frame.png"
    rc, err = _cli(capsys, "--config_json", config_path, "--prompt", "x", "--target_video_length", 1,
                   "--save_result_path", png)
    _assert_invalid(rc, err, f"`save_result_path` {str(png)!r} (request on command line) needs the `media` extra",
                    "missing: imageio.v3")
    rc, err = _cli(capsys, "--config_json", config_path, "--prompt", "x", "--target_video_length", 1,
                   "--save_tensor_path", tmp_path / "t.safetensors")
    assert rc == 0, err


# ---- issue 19: the memory check's order and messages before loading ---------------------------------
SYNTHETIC_ORIGINAL_HINT = (
    "  hint: this synthetic checkpoint's original layout records only the transformer's architecture (config.json); "
    "run it with the config that wrote it (its `model` key gives the text encoder, VAE and image encoder sizes)")


@pytest.mark.parametrize("check_fit", [True, False])
def test_a_synthetic_original_checkpoint_without_its_model_gets_the_hint_not_shape_advice(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], check_fit: bool) -> None:
    """Issue 19: without the config's `model`, the original layout's text encoder and VAE are the
    released sizes; the memory check estimated those and advised a smaller shape (wrong), and the
    real hint came only with check_fit off. Now the hint comes first in both cases, before loading."""
    from runnerkit.models.wan.arch import WanArch
    from runnerkit.models.wan.checkpoint import write_synthetic

    data = json.loads((REPO / "configs/wan/wan_t2v_tiny.json").read_text())
    ckpt = tmp_path / "orig"
    write_synthetic(WanArch.model_validate(data["model"]), ckpt, seed=0, dtype=torch.float32, layout="original")
    config = tiny_config_dict(ckpt, memory={"limit_gib": 1.0} if check_fit else {"check_fit": False})
    del config["model"]
    rc, err = _cli(capsys, "--config_json", write_config(tmp_path / "c.json", config), "--prompt", "x",
                   "--save_tensor_path", tmp_path / "o.safetensors")
    phase = "invalid input: " if check_fit else "load failed: CheckpointError: "
    _assert_invalid(rc, err, f"| ERROR   | {phase}text_encoder: checkpoint does not match the architecture; missing keys",
                    "\n" + SYNTHETIC_ORIGINAL_HINT + "\n")
    assert "Try a smaller" not in err and "needs an estimated" not in err
    assert ("holds SYNTHETIC RANDOM weights" in err) is not check_fit  # logged by the load: with the check on, none


def test_a_missing_model_path_says_the_memory_check_waits_for_the_load(tiny_ckpt: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 19: a family that has an estimate logged 'gives no memory estimate' when its checkpoint
    could not be read before loading."""
    missing = tmp_path / "no_such_ckpt"
    cfg = write_config(tmp_path / "c.json", tiny_config_dict(tiny_ckpt, model_path=str(missing)))
    rc, err = _cli(capsys, "--config_json", cfg, "--prompt", "x")
    reason = (f"`model_path` {str(missing)!r} does not exist or is not a folder (set `synthetic_checkpoint` to write "
              "random weights there)")
    info = [line.split(" | ", 2)[2] for line in err.splitlines() if "memory check" in line]
    assert info == ["memory check: waits for the load, then checks each request before it runs: the checkpoint's "
                    f"architecture cannot be read before loading ({reason})"], err
    _assert_invalid(rc, err, f"| ERROR   | load failed: CheckpointError: {reason}")
    assert "gives no memory estimate" not in err

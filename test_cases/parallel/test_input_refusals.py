"""Invalid input under torchrun (2 ranks on the CPU, gloo): every rank reads the same command line,
so rank 0 alone reports it ("invalid input: ...", once) and every rank exits 2, as one process
does; no rank is left to the launcher's SIGTERM (exit -15) or reported as a rank's crash (exit 1).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_cases.conftest import REPO, config_dict
from test_cases.parallel.test_multi_rank import ERROR_LINE, QWEN_CONFIG, TIMEOUT_S, _config, _env, _free_port

LTX2_CONFIG = REPO / "configs" / "ltx2" / "ltx2_t2av_tiny.json"
RANK_EXIT = re.compile(r"rank\s+: (\d) \(local_rank: \d\)\n\s+exitcode\s+: (-?\d+)")


def torchrun(config: Path) -> tuple[str, list[tuple[str, str]]]:
    """`runnerkit --config_json CONFIG --prompt ...` on 2 ranks through torchrun: (output, [(rank, exit status)])."""
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(_free_port()), "-m", "runnerkit.infer", "--config_json", str(config), "--prompt",
                          "a red fox in the snow"], cwd=REPO, env=_env(), capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    output = run.stdout + run.stderr
    assert run.returncode == 1, output  # torchrun's own status once any rank fails
    return output, sorted(RANK_EXIT.findall(output))


def test_an_invalid_config_is_reported_once_by_rank_0(tmp_path: Path) -> None:
    """The tiny LTX-2 config (CFG off) with `parallel.cfg` 2 is refused while parsing, before the group
    exists: the two-line error appears once and both ranks exit 2."""
    config = tmp_path / "ltx2_cfg2.json"
    config.write_text(json.dumps(config_dict(LTX2_CONFIG, tmp_path / "unused", parallel={"cfg": 2, "timeout_s": 20.0})))
    output, ranks = torchrun(config)
    assert ERROR_LINE.findall(output) == [f"invalid input: invalid config {config}:"], output
    assert output.count("`parallel.cfg`=2 runs the two CFG branches on two ranks, but `enable_cfg` is false") == 1, output
    assert ranks == [("0", "2"), ("1", "2")], output


def test_a_request_ulysses_cannot_split_is_invalid_input(tmp_path: Path) -> None:
    """Tiny Qwen-Image at its default 48x80 (15 image tokens) with `parallel.ulysses` 2: the request
    check refuses it after loading, rank 0 alone logs it as invalid input with the request's index,
    and both ranks exit 2."""
    from runnerkit.models.qwen_image.arch import QwenImageArch
    from runnerkit.models.qwen_image.checkpoint import write_synthetic

    ckpt = write_synthetic(QwenImageArch.model_validate(json.loads(QWEN_CONFIG.read_text())["model"]),
                           tmp_path / "qwen", seed=0, dtype=torch.float32)
    output, ranks = torchrun(_config(ckpt, tmp_path, {"ulysses": 2}, QWEN_CONFIG))
    assert ERROR_LINE.findall(output) == [
        "invalid input: request 0 (command line): `parallel.ulysses`=2 needs the transformer's tokens divisible by 2, "
        "got 15 (stage 'transformer' at shape [48, 80, 1]; choose a shape whose tokens divide)"], output
    assert ranks == [("0", "2"), ("1", "2")], output


def test_a_request_that_cannot_fit_is_invalid_input(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Tiny Wan with `parallel.cfg` 2 and a 4096x4096 request on a 1 GiB `memory.limit_gib`: the plan phase
    refuses it before loading; rank 0 alone logs it as invalid input and both ranks exit 2 (it was a
    rank's failure, exit 1)."""
    config = _config(tiny_ckpt, tmp_path, {"cfg": 2, "timeout_s": 20.0}, memory={"limit_gib": 1.0},
                     target_height=4096, target_width=4096)
    output, ranks = torchrun(config)
    lines = ERROR_LINE.findall(output)
    assert len(lines) == 1 and lines[0].startswith("invalid input: request 0 (command line): shape 4096x4096x"), output
    assert ranks == [("0", "2"), ("1", "2")], output


def test_a_parallel_mode_the_family_lacks_is_invalid_input_before_any_group(tmp_path: Path) -> None:
    """The tiny LTX-2 config with `parallel.ulysses` 2 (LTX-2 declares no parallel mode) is refused while the
    launch is parsed, in one process as under torchrun (where it ended as a rank's load failure, exit 1): the
    family's refusal, not the torchrun advice a missing process group gives."""
    from runnerkit.config import ConfigError
    from runnerkit.infer import build_parser, parse_inputs

    config = tmp_path / "ltx2_ulysses2.json"
    config.write_text(json.dumps(config_dict(LTX2_CONFIG, tmp_path / "unused", parallel={"ulysses": 2})))
    args = build_parser().parse_args(["--config_json", str(config), "--prompt", "a red fox in the snow"])
    with pytest.raises(ConfigError) as refused:
        parse_inputs(args)
    assert str(refused.value) == ("`parallel`: LTX2Runner (task 't2av') does not support ['ulysses'] parallel "
                                  "(supported: [])")

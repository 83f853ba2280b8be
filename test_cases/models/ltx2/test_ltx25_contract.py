"""The LTX-2.5 runner under the family contract (test_cases/family_contract.py): warmup gates, every
offload mode bit-identical to a cold `none` runner after warmup, the request boundary (also after a
failed and a cancelled request), and parity with diffusers' LTX-2.5 chain through the parity hook.

The requests are the tiny flavour's two warmup shapes: SMALL gives its frames (64 x 64 x 9), LARGE omits
them (admitted at the bounds' largest count, 64 x 128 x 33; the duration head predicts 25). The CPU estimate is
checked at SMALL: on the CPU the diffusion decoder's dense [N, N] attention mask, outside the formula
(estimate_diffusion_decoder.py), outgrows it at LARGE's 3200 stage-5 tokens (measured 52.9 MiB, formula 20.5)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from runnerkit.config import RequestConfig
from runnerkit.models.ltx2.arch25 import tiny_ltx25_arch
from runnerkit.models.ltx2.checkpoint25 import write_synthetic_ltx25
from runnerkit.models.ltx2.runner25 import LTX25Runner
from test_cases.family_contract import Family, FamilyContract

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "ltx2" / "ltx25_t2av_tiny.json"
SMALL = RequestConfig(prompt="a red fox runs through fresh snow, wind howls", seed=11, target_height=64,
                      target_width=64, target_video_length=9)
LARGE = RequestConfig(prompt="waves break on a rocky shore", seed=12)
STREAM_ALL = ["text_encoder", "connectors", "transformer"]
MODES: dict[str, dict[str, Any]] = {
    "none": {"offload": {"mode": "none"}},
    "model": {"offload": {"mode": "model"}},
    "block_disk_mmap": {"offload": {"mode": "block", "storage": "disk", "reader": "mmap"}},
    "phase_disk_pread": {"offload": {"mode": "phase", "storage": "disk", "reader": "pread"}},
    "block_disk_lazy_load": {"offload": {"mode": "block", "storage": "disk", "lazy_load": True}},
    # every module that can stream does: Gemma-4's layers (text_encoder_gemma4_stream.py) too
    "block_cpu_streams_gemma4": {"offload": {"mode": "block", "storage": "cpu", "stream_modules": STREAM_ALL}},
    "phase_disk_lazy_streams_gemma4": {"offload": {"mode": "phase", "storage": "disk", "lazy_load": True,
                                                   "stream_modules": STREAM_ALL}},
}


@pytest.fixture(scope="module")
def checkpoint25(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny config's synthetic checkpoint, as the runner writes it."""
    return write_synthetic_ltx25(tiny_ltx25_arch(), tmp_path_factory.mktemp("ltx25") / "diffusers", 0, torch.float32)


def config_dict(ckpt: Path, **overrides: Any) -> dict[str, Any]:
    data = {**json.loads(CONFIG.read_text()), "device": "cpu", "model_path": str(ckpt), **overrides}
    return {k: v for k, v in data.items() if v is not None}


def ltx25_boundary(runner: LTX25Runner) -> None:
    """The request-specific cache: the transformer's RoPE tables per grid."""
    assert runner.transformer is None or runner.transformer._rope_cache == {}


def ltx25_after_mode(mode: str, runner: LTX25Runner) -> None:
    """Gemma-4 streamed: its streamer moved every layer (storage cpu), or, built per request, none is left."""
    if mode == "block_cpu_streams_gemma4":
        streamer = runner.streamers["text_encoder"]
        # warmup's one text stage (its embeddings serve both shapes) and the two requests
        assert streamer.stats()["h2d_copies"] >= 3 * len(streamer.units) > 0
    elif mode == "phase_disk_lazy_streams_gemma4":
        assert "text_encoder" not in runner.streamers


def ltx25_parity(request: pytest.FixtureRequest, folder: Path) -> None:
    from test_cases.models.ltx2.test_runner25_parity import test_t2av_frames_omitted_matches_diffusers

    test_t2av_frames_omitted_matches_diffusers(folder, request.getfixturevalue("monkeypatch"))


class TestFamilyContract(FamilyContract):
    """After warmup, SMALL and LARGE (frames omitted) equal the cold reference bit for bit in every mode."""

    family = Family(
        name="ltx2.5 t2av", runner_cls=LTX25Runner, checkpoint="checkpoint25", config=config_dict,
        requests=(SMALL, LARGE), outputs=("video", "audio"), modes=MODES, warmup_arms=(True,),
        shapes=({"video": (3, 9, 64, 64), "audio": (2, 15840)}, {"video": (3, 25, 64, 128), "audio": (2, 48480)}),
        boundary=ltx25_boundary, after_mode=ltx25_after_mode, estimate_request=SMALL, parity=ltx25_parity,
        reference_package="diffusers")

"""What the LTX-2.5 runner's memory estimate takes before loading when its files are absent
(`runnerkit plan` of configs/ltx2/ltx25_*_22b_distilled.json on a machine without the release).

As for LTX-2.x (`plan_sources.py`), a runner built to plan only whose checkpoint (`model_path`) does not
exist takes what the files would say from what the config gives or implies:

- the architecture: the config's `model` (the whole LTX-2.5 architecture), else the release the
  checkpoint's file or folder name names (`RELEASES_25`: `ltx-2.5-22b...`, as Lightricks names the
  transformer file `diffusion_models/ltx-2.5-22b-distilled-transformer-bf16.safetensors`) ->
  `arch25.LTX25_22B_PIPELINE_ARCH`;
- the Gemma-4 text model's config: the packed file's `gemma_config` or the folder's config.json where it exists
  (`text_encoder_path`; omitted, the packed file in the release's `text_encoders/` or the checkpoint folder's
  `text_encoder/`), else Gemma-4 12B's sizes (`ltx25_arch.GEMMA4_12B_TEXT`, whose width and depth the
  connectors fix: checked against them);
- fp8 storage and the omitted frame count: as `plan_sources.fp8_by_name`, and the largest count the duration
  head can predict (`LTX25Runner.frame_bounds`).

Each is said in the plan's output (`estimate_sources`). A run (not `for_plan`) never takes them.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runnerkit.config import RunnerConfig
from runnerkit.models.ltx2.arch25 import LTX25_22B_PIPELINE_ARCH, LTX25Arch
from runnerkit.models.ltx2.ltx25_arch import GEMMA4_12B_TEXT
from runnerkit.models.ltx2.plan_sources import absent_sources, check_paths
from runnerkit.models.ltx2.text_encoder_packed import is_packed_file
from runnerkit.planning.fit import EstimateUnavailable

if TYPE_CHECKING:
    from runnerkit.models.ltx2.runner25 import LTX25Runner

__all__ = ["RELEASES_25", "absent_sources_25", "check_paths_25", "estimate_sources_25", "frames_source",
           "gemma4_present", "gemma4_text_dict", "release_gemma4"]

#: (pattern of the checkpoint's file or folder name, lower case; the release's architecture; its name).
RELEASES_25 = ((r"ltx-?2\.5-22b", LTX25_22B_PIPELINE_ARCH, "LTX-2.5 22B"),)


def release_gemma4(arch: LTX25Arch) -> dict[str, Any]:
    """Gemma-4 12B's text config (`GEMMA4_12B_TEXT`, transformers' defaults for the rest) for `arch`'s
    connectors, which take its width and its layers + 1 hidden states.

    Raises:
        EstimateUnavailable: the connectors are sized for another text model (give `text_encoder_path`, a
            folder with its config.json).
    """
    c = arch.connectors
    sizes = (GEMMA4_12B_TEXT["hidden_size"], GEMMA4_12B_TEXT["num_hidden_layers"])
    if (c.caption_channels, c.text_proj_in_factor - 1) != sizes:
        raise EstimateUnavailable(f"the connectors take a {c.caption_channels}-wide text model of "
                                  f"{c.text_proj_in_factor - 1} layers, not Gemma-4 12B: give `text_encoder_path` "
                                  "(a folder with its config.json)")
    return gemma4_text_dict(GEMMA4_12B_TEXT)


def gemma4_text_dict(sizes: dict[str, Any]) -> dict[str, Any]:
    """`transformers.Gemma4UnifiedTextConfig(**sizes).to_dict()`, built once per distinct `sizes` (a planner
    estimates hundreds of candidate plans with the same text model; building the config is milliseconds each).
    Each call returns its own top-level dict."""
    return dict(_gemma4_text_dict(json.dumps(sizes, sort_keys=True)))


@functools.lru_cache(maxsize=16)
def _gemma4_text_dict(sizes_json: str) -> dict[str, Any]:
    import transformers

    return transformers.Gemma4UnifiedTextConfig(**json.loads(sizes_json)).to_dict()


def frames_source(config: RunnerConfig, largest: int, bounds: tuple[float, float]) -> str | None:
    """The plan's line on an omitted frame count (None when the config gives one): it is planned at `largest`,
    the largest count the duration head's prediction can take within `bounds` (seconds) at the config's fps."""
    if config.target_video_length is not None:
        return None
    return (f"frames: omitted by the config (the duration head predicts them per request): planned at {largest}, "
            f"the largest count a prediction can take ({bounds[0]:g} s to {bounds[1]:g} s at {config.fps} fps)")


def gemma4_present(source: Path) -> bool:
    """Whether the Gemma-4 text encoder at `source` (a packed `.safetensors` file or a folder) can be read."""
    return source.is_file() if is_packed_file(source) else (source / "config.json").is_file()


def check_paths_25(config: RunnerConfig, files: bool = True) -> None:
    """`plan_sources.check_paths` for LTX-2.5: with a single-file `model_path` (the release's transformer file),
    `upsampler_path` is required; `text_encoder_path` is optional (omitted: the packed file is found in the release's
    `text_encoders/` at load) and, when given, the packed `.safetensors` file or a Gemma-4 folder. A folder
    `model_path` takes neither. Checked when the runner is built, before anything loads.

    Args:
        files: check that the given paths exist (False: a runner that only plans, `for_plan`).

    Raises:
        ValueError: naming the missing, absent or superfluous field (the files' contents are checked at load).
    """
    single = config.model_path is not None and config.model_path.endswith(".safetensors")
    if not single:
        check_paths(config, files)  # refuses either path beside a checkpoint folder
        return
    upsampler, text_encoder = config.upsampler_path, config.text_encoder_path
    if upsampler is None:
        raise ValueError(f"`upsampler_path` is required with a single-file `model_path` ({config.model_path}): the "
                         "release ships the x2 latent upsampler as a file of its own")
    if files and not Path(upsampler).is_file():
        raise ValueError(f"`upsampler_path` {upsampler!r} is not an existing file: give the x2 latent upsampler "
                         f".safetensors shipped beside `model_path` ({config.model_path})")
    if files and text_encoder is not None:
        packed = is_packed_file(text_encoder)
        if not (Path(text_encoder).is_file() if packed else Path(text_encoder).is_dir()):
            raise ValueError(f"`text_encoder_path` {text_encoder!r} is not an existing {'file' if packed else 'folder'}"
                             ": give the release's packed Gemma-4 file (text_encoders/gemma4-12b-with-proj-ltx-2.5-"
                             "bf16.safetensors), a Gemma-4 folder, or leave it out to find the packed file in "
                             "`text_encoders/`")


def absent_sources_25(config: RunnerConfig, arch_source: str, gemma_folder: Path, fp8: frozenset[str]) -> list[str]:
    """The plan's lines on what an absent LTX-2.5 checkpoint's estimate takes (module docstring): `arch_source`
    from `plan_sources.configured_arch`, the Gemma-4 file or folder looked at, the fp8-stored weights."""
    default = "Gemma-4 12B (ltx25_arch.GEMMA4_12B_TEXT, the release's text encoder)"
    lines = absent_sources(config, arch_source, gemma_folder, fp8, "Gemma-4", default)
    if is_packed_file(gemma_folder):
        lines[1] = (f"Gemma-4 sizes: metadata `gemma_config` of {gemma_folder}" if gemma_folder.is_file() else
                    f"Gemma-4 sizes: {default}: {gemma_folder} does not exist")
    return lines


def estimate_sources_25(runner: LTX25Runner) -> list[str]:
    """`LTX25Runner.estimate_sources`: LTX-2's lines (planning.py), Gemma-4's for an absent checkpoint
    (`absent_sources_25`), then the frame count an omitted one is planned at (`frames_source`), then where the
    prompt enhancer's sizes come from (with a `prompt_enhancer` section: estimate_enhancer.py `enhancer_config`)."""
    from runnerkit.models.ltx2.planning import estimate_sources, fp8_transformer_weights

    if runner.checkpoint is None and runner.checkpoints.absent() and runner.arch_override is not None:
        lines = absent_sources_25(runner.config, runner.arch_source,
                                  runner.gemma4_folder(runner.checkpoints.path()), fp8_transformer_weights(runner))
    else:
        lines = estimate_sources(runner)
    frames = frames_source(runner.config, runner.frame_bounds(runner.config)[1], runner.duration_bounds(runner.config))
    lines += [frames] if frames else []
    if runner.config.prompt_enhancer is not None:  # its folder's config.json, or the release's sizes
        from runnerkit.models.ltx2.estimate_enhancer import enhancer_config

        lines.append(enhancer_config(runner.config)[1])
    return lines

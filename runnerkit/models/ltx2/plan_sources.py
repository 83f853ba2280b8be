"""What the LTX-2 runner's memory estimate needs before loading, when its files are absent, and the
single-file release's companion paths.

A runner built to plan only (`BaseRunner.for_plan`, `runnerkit plan`) whose checkpoint (`model_path`)
does not exist takes what the files would say from what the config gives or implies:

- the architecture: the config's `model` (the whole LTX-2 architecture, diffusers' field names), else the
  release the checkpoint's file or folder name names (`RELEASES`: `ltx-2.3-22b...` is LTX-2.3 22B,
  `ltx-2-19b...` LTX-2 19B, as Lightricks names its files);
- the Gemma-3 text model's sizes: its config.json where the folder exists (`text_encoder_path`, or the
  checkpoint folder's `text_encoder/`), else Gemma-3 12B (`GEMMA3_12B`, `google/gemma-3-12b-it`), the
  text encoder of both releases, whose width and depth the connectors fix (checked against them);
- the transformer weights stored in fp8 (which the headers say): none, unless the file name says `fp8`
  (Lightricks' `*-fp8.safetensors`), which store the blocks' 2-D linear weights in float8_e4m3fn.

Each of these is said in the plan's output (`estimate_sources`). A run (not `for_plan`) never takes them:
its load refuses missing files with their own messages.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from runnerkit.config import RunnerConfig
from runnerkit.models.ltx2.arch import LTX2_19B_ARCH, LTX23_22B_ARCH, LTX2Arch
from runnerkit.planning.fit import EstimateUnavailable

__all__ = ["GEMMA3_12B", "RELEASES", "absent_sources", "check_paths", "configured_arch", "fp8_by_name",
           "release_gemma"]

#: (pattern of the checkpoint's file or folder name, lower case; the release's architecture; its name).
RELEASES: tuple[tuple[str, LTX2Arch, str], ...] = (
    (r"ltx-?2\.3-22b", LTX23_22B_ARCH, "LTX-2.3 22B"),
    (r"ltx-?2-19b", LTX2_19B_ARCH, "LTX-2 19B"),
)
GEMMA3_12B: dict[str, int] = {"vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360,
                              "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
                              "head_dim": 256}
"""`google/gemma-3-12b-it`'s text model (its config.json `text_config`), the text encoder both releases ship."""


def check_paths(config: RunnerConfig, files: bool = True) -> None:
    """A single `.safetensors` file needs `text_encoder_path` (a folder) and `upsampler_path` (a file),
    both present; a folder needs neither. Checked when the runner is built, before anything loads.

    Args:
        files: check that the two paths exist (False: a runner that only plans, `for_plan`).

    Raises:
        ValueError: naming the missing, absent or superfluous field (the files' contents are checked at load).
    """
    single = config.model_path is not None and config.model_path.endswith(".safetensors")
    wanted = {"text_encoder_path": ("folder", Path.is_dir, "the Gemma-3 folder (config.json, tokenizer, weights)"),
              "upsampler_path": ("file", Path.is_file, "the x2 latent upsampler .safetensors")}
    for key, (kind, exists, what) in wanted.items():
        value = getattr(config, key)
        if single and value is None:
            raise ValueError(f"`{key}` is required with a single-file `model_path` ({config.model_path}): the "
                             "release ships the Gemma-3 folder and the upsampler file separately")
        if single and files and not exists(Path(value)):
            raise ValueError(f"`{key}` {value!r} is not an existing {kind}: give {what} shipped beside the "
                             f"single-file `model_path` ({config.model_path})")
        if not single and value is not None:
            raise ValueError(f"`{key}` ({value!r}) is only read with a single-file `model_path` (.safetensors); "
                             "a checkpoint folder holds its own: remove it")


def configured_arch(config: RunnerConfig, parsed: LTX2Arch | None,
                    releases: Sequence[tuple[str, LTX2Arch, str]] = RELEASES) -> tuple[LTX2Arch | None, str]:
    """The architecture of an absent checkpoint and where it comes from (module docstring): `parsed` (the
    config's `model`, validated whole) if given, else the release `model_path`'s name names among `releases`
    (LTX-2.5: `plan_sources25.RELEASES_25`); (None, why) if neither."""
    if parsed is not None:
        return parsed, "the config's `model`"
    name = Path(config.model_path or "").name
    for pattern, arch, release in releases:
        if re.search(pattern, name.lower()):
            return arch, f"the {release} release, named by `model_path`'s name {name!r}"
    known = ", ".join(f"{release} ({pattern!r})" for pattern, _, release in releases)
    return None, (f"`model_path` {config.model_path} does not exist and its name names no known release ({known}): "
                  "give the config's `model` (the whole LTX-2 architecture) or the checkpoint")


def release_gemma(arch: LTX2Arch) -> dict[str, int]:
    """Gemma-3 12B's sizes (`GEMMA3_12B`) for `arch`'s connectors, which take its width and its layers + 1
    hidden states.

    Raises:
        EstimateUnavailable: the connectors are sized for another text model (give `text_encoder_path` with its
            config.json).
    """
    c = arch.connectors
    if (c.caption_channels, c.text_proj_in_factor - 1) != (GEMMA3_12B["hidden_size"], GEMMA3_12B["num_hidden_layers"]):
        raise EstimateUnavailable(f"the connectors take a {c.caption_channels}-wide text model of "
                                  f"{c.text_proj_in_factor - 1} layers, not Gemma-3 12B: give `text_encoder_path` (a "
                                  "folder with its config.json)")
    return dict(GEMMA3_12B)


def fp8_by_name(path: Path, arch: LTX2Arch) -> frozenset[str]:
    """The transformer weights (our names) an absent checkpoint at `path` stores in float8_e4m3fn, by its name:
    with `fp8` in it an fp8 release's (`estimate.fp8_release_weights`: the blocks' 2-D linear weights); else none."""
    if "fp8" not in path.name.lower():
        return frozenset()
    from runnerkit.models.ltx2.estimate import fp8_release_weights

    return fp8_release_weights(arch)


def absent_sources(config: RunnerConfig, arch_source: str, gemma_folder: Path, fp8: frozenset[str],
                   gemma_name: str = "Gemma-3",
                   gemma_default: str = "Gemma-3 12B (google/gemma-3-12b-it, the releases' text encoder)") -> list[str]:
    """The plan's lines on what an absent checkpoint's estimate takes (module docstring): `arch_source` from
    `configured_arch`, the text encoder's folder looked at (`gemma_name`; `gemma_default` the sizes taken
    without its config.json), the fp8-stored weights `fp8_by_name` gave."""
    gemma = (f"{gemma_name} sizes: {gemma_folder / 'config.json'}" if (gemma_folder / "config.json").is_file() else
             f"{gemma_name} sizes: {gemma_default}: {gemma_folder} has no config.json")
    stored = (f"fp8 storage: {len(fp8)} transformer block weights assumed float8_e4m3fn (`fp8` in the file name)"
              if fp8 else "fp8 storage: none assumed (the bf16 release; the checkpoint's headers would tell)")
    return [f"architecture: {arch_source} (`model_path` {config.model_path} does not exist)", gemma, stored]

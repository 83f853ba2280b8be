"""The planner's table: which plan each shipped release config gets on a grid of GPU and host memory sizes,
from the architecture alone (no weights), with the estimated request time (docs/memory_plan.md, "The plans,
machine by machine").

    python -m runnerkit.tools.plan_table            # print the markdown tables
    python -m runnerkit.tools.plan_table --write    # replace the tables in docs/memory_plan.md

Each model's config is planned as `runnerkit plan --config_json CONFIG --offload auto --device_gib D --host_gib H
--device_name REFERENCE_DEVICE` plans it (the default shape and, with `warmup`, the warmup shapes; the family's estimate of the
release architecture; the compute of `REFERENCE_DEVICE`, the memory capped at D GiB). One planning runner per
model serves every size: its estimates and the candidates' limit-independent measurements
(`ladder.measure`) are pure functions of (offload config, shape) and shared across the sizes.

A cell: the placement of each module in short words (`MODULE_SHORT`, `PLACEMENT_SHORT`) and the estimated
seconds per request, or `refused` where no plan fits.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from loguru import logger

from runnerkit.config import OffloadConfig, load_runner_config
from runnerkit.memory import MemoryLimit
from runnerkit.registry import get_runner_cls
from runnerkit.planning import fit, planner
from runnerkit.planning.fit import GIB, MemoryFitError
from runnerkit.runners.pipeline import Shape
from runnerkit.planning.report import module_rows

__all__ = ["DEVICE_GIB", "HOST_GIB", "MODELS", "REFERENCE_DEVICE", "Cell", "markdown", "plan_model", "table"]

REPO = Path(__file__).resolve().parents[2]
DEVICE_GIB: tuple[int, ...] = (8, 12, 16, 24, 32, 48, 80, 141)
HOST_GIB: tuple[int, ...] = (16, 32, 64, 128)
MODELS_FILE = REPO / "configs" / "plan_table.json"
"""The table's models, one table each: `{"models": [{"title": ..., "config": "configs/..."}]}`."""


def _models() -> tuple[tuple[str, str], ...]:
    entries = json.loads(MODELS_FILE.read_text())["models"]
    return tuple((entry["title"], entry["config"]) for entry in entries)


#: (title, shipped config): one model per table, from `MODELS_FILE`.
MODELS: tuple[tuple[str, str], ...] = _models()
REFERENCE_DEVICE = "NVIDIA H100 80GB HBM3"
"""The compute every cell assumes (989 TFLOP/s dense bf16, as the H200's): a smaller GPU is modelled as this one
with its memory capped (`memory.limit_gib`), so a cell shows what the memory costs, not a slower chip."""

MODULE_SHORT = {"text_encoder": "te", "image_encoder": "clip", "transformer": "dit", "transformer_2": "dit2",
                "connectors": "conn", "latent_upsampler": "up", "vae": "vae", "audio_decoder": "audio"}
"""Module names in a cell."""


def _placement_short(placement: str) -> str:
    """`fit.placement_of`'s words in a cell: R resident, V visits, S streamed from pinned memory (Sh pageable, Sd
    disk), +N units resident, L built per request."""
    if placement == "resident":
        return "R"
    if placement.startswith("visits"):
        return "V"
    if placement == "built for its stage":
        return "B"
    source = {"pinned host memory": "S", "host memory": "Sh", "disk": "Sd"}
    words = placement.removeprefix("streamed from ").split(", ")
    out = source[words[0]]
    units = next((w.split()[0] for w in words[1:] if w.endswith("units resident")), None)
    out += f"+{units}" if units else ""
    return out + ("L" if "built per request" in words else "")


@dataclass(frozen=True)
class Cell:
    """One plan of the table: the placement of each module (`fit.placement_of`), the estimated request seconds
    (None: no compute estimate), the chosen concrete offload config; all None where nothing fits."""

    placements: tuple[tuple[str, str], ...] | None
    seconds: float | None
    offload: OffloadConfig | None

    def short(self) -> str:
        if self.placements is None:
            return "refused"
        words = " ".join(f"{MODULE_SHORT.get(n, n)}:{_placement_short(p)}" for n, p in self.placements)
        return words + (f" {self.seconds:.0f} s" if self.seconds is not None else "")


def plan_model(config_json: str | Path, devices: Sequence[float] = DEVICE_GIB, hosts: Sequence[float] = HOST_GIB,
               device_name: str = REFERENCE_DEVICE) -> dict[tuple[float, float], Cell]:
    """(device GiB, host GiB) -> the plan of `config_json` (its checkpoint absent: the architecture the config
    gives or implies) on a CUDA device of that size with `device_name`'s compute (module docstring)."""
    path = Path(config_json)
    data = load_runner_config(path, {}).model_dump(exclude_unset=True)
    absent = str(Path("/nonexistent-checkpoints") / str(data["model_path"]))  # the release's file name kept (a family may read it)
    config = load_runner_config(path, {"model_path": absent, "memory.limit_gib": max(devices), "offload.mode": "auto"})
    runner = get_runner_cls(config.model_cls, config.task).for_plan(config, torch.device("cuda"))
    checks = runner.memory_checks
    checks.planned_device_name = device_name
    cfg, device = runner.config, checks.memory_device()
    shapes: list[Shape] = [checks.default_shape()]  # frames omitted: the family's count for a request without
    shapes += list(runner.warmup_shapes()) if cfg.warmup else []
    estimates: dict[tuple[str, Shape], fit.MemoryEstimate] = {}

    def estimate(off: OffloadConfig, shape: Shape) -> fit.MemoryEstimate:
        key = (off.model_copy(update={"resident_modules": None}).model_dump_json(), shape)
        if key not in estimates:
            estimates[key] = checks.estimate_with(off, shape)
        return estimates[key]

    compute, note = checks.compute_model(shapes)
    memo = planner.PlanMemo()
    out: dict[tuple[float, float], Cell] = {}
    for d in devices:
        for h in hosts:
            try:
                result = planner.plan_offload(
                    cfg, shapes, device, estimate, MemoryLimit(int(d * GIB), "table"), MemoryLimit(int(h * GIB),
                                                                                                  "table"),
                    checks.denoise_passes_per_step, checks.plan_supports, (runner.SPATIAL_FACTOR,
                                                                           runner.TEMPORAL_FACTOR),
                    runner.plan_steps_per_request(), compute=compute, compute_note=note, memo=memo)
            except MemoryFitError:
                out[d, h] = Cell(None, None, None)
                continue
            rows = module_rows(result.chosen, device)
            out[d, h] = Cell(tuple((r.name, r.placement) for r in rows), result.chosen.request_seconds,
                             result.offload)
    return out


def table(models: Sequence[tuple[str, str]] = MODELS) -> dict[str, dict[tuple[float, float], Cell]]:
    """Every model's plans (title -> `plan_model`)."""
    return {title: plan_model(REPO / config) for title, config in models}


def markdown(plans: dict[str, dict[tuple[float, float], Cell]]) -> str:
    """One table per model: a row per GPU size, a column per host size."""
    lines: list[str] = []
    for title, cells in plans.items():
        devices = sorted({d for d, _ in cells})
        hosts = sorted({h for _, h in cells})
        lines += [f"**{title}**", "", "| GPU \\ host | " + " | ".join(f"{h:g} GiB" for h in hosts) + " |",
                  "|---|" + "---|" * len(hosts)]
        lines += [f"| {d:g} GiB | " + " | ".join(cells[d, h].short() for h in hosts) + " |" for d in devices]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


BEGIN, END = "<!-- plan table: begin (python -m runnerkit.tools.plan_table --write) -->", "<!-- plan table: end -->"


def replace_in(doc: str, tables: str) -> str:
    """`doc` with the text between the markers replaced by `tables`.

    Raises:
        ValueError: the markers are missing.
    """
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), flags=re.DOTALL)
    if not pattern.search(doc):
        raise ValueError(f"the document has no `{BEGIN}` ... `{END}` block")
    return pattern.sub(lambda m: f"{BEGIN}\n\n{tables}\n{END}", doc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runnerkit.tools.plan_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="replace the tables in docs/memory_plan.md")
    args = p.parse_args(argv)
    logger.remove()
    text = markdown(table())
    if args.write:
        doc = REPO / "docs" / "memory_plan.md"
        doc.write_text(replace_in(doc.read_text(), text))
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

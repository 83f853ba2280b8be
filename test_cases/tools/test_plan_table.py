"""The planner's table (runnerkit/tools/plan_table.py): every release config of docs/memory_plan.md on every GPU x
host size, from the architecture alone. More memory never gives a longer estimated request; a refusal only at
the small end; a cell is the plan `runnerkit plan` prints; the doc's tables are current.

The whole table is planned once per pytest run (one planning runner per model; estimates and measured
candidates shared across the sizes; `built_once_per_run` shares it between the xdist workers): ~10 s of CPU
on a free core, most of it LTX-2.3's six modules.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from runnerkit.cli import main as cli_main
from runnerkit.tools import plan_table
from runnerkit.tools.plan_table import Cell
from test_cases._cli import restore_logger  # noqa: F401 (autouse fixture)
from test_cases.conftest import REPO, built_once_per_run

Table = dict[str, dict[tuple[float, float], Cell]]


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Table:
    def build(folder: Path) -> None:
        (folder / "table.pickle").write_bytes(pickle.dumps(plan_table.table()))

    return pickle.loads((built_once_per_run(tmp_path_factory, "plan_table", build) / "table.pickle").read_bytes())


def test_more_memory_never_gives_a_longer_request_and_refusals_are_at_the_small_end(table: Table) -> None:
    assert len(table) == 5 and all(len(cells) == 8 * 4 for cells in table.values())
    for title, cells in table.items():
        for (d, h), cell in cells.items():
            for (d2, h2), more in cells.items():
                if d2 < d or h2 < h:
                    continue
                if cell.placements is not None:  # a refusal only where every smaller machine is refused too
                    assert more.placements is not None, (title, (d, h), (d2, h2))
                    assert more.seconds is not None and cell.seconds is not None
                    assert more.seconds <= cell.seconds + 1e-9, (title, (d, h), cell, (d2, h2), more)
        fitting = [c for c in cells.values() if c.placements is not None]
        assert fitting and all(c.seconds is not None and c.seconds > 0 for c in fitting), title
        assert cells[max(plan_table.DEVICE_GIB), max(plan_table.HOST_GIB)].offload is not None


def test_the_largest_machines_keep_every_module_resident(table: Table) -> None:
    for title, cells in table.items():
        top = cells[141, 128]
        assert top.placements is not None and {p for _, p in top.placements} == {"resident"}, (title, top)


def test_the_doc_holds_the_current_tables(table: Table) -> None:
    doc = (REPO / "docs" / "memory_plan.md").read_text()
    assert plan_table.replace_in(doc, plan_table.markdown(table)) == doc, (
        "docs/memory_plan.md's plan tables are stale: run `python -m runnerkit.tools.plan_table --write`")


def test_a_cell_is_the_plan_runnerkit_plan_prints(table: Table, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # the config's `models/...` path exists nowhere
    title, config = plan_table.MODELS[1]  # Wan2.1 14B
    capsys.readouterr()
    rc = cli_main(["plan", "--config_json", str(REPO / config), "--offload", "auto", "--device_gib", "24",
                   "--host_gib", "64", "--device_name", plan_table.REFERENCE_DEVICE, "--json"])
    out = json.loads(capsys.readouterr().out)
    cell = table[title][24, 64]
    assert rc == 0 and cell.offload is not None
    assert out["offload"] == cell.offload.model_dump(mode="json")
    assert cell.seconds is not None and out["estimated_request_seconds"] == round(cell.seconds, 3)
    assert [(m["name"], m["placement"]) for m in out["modules"]] == list(cell.placements or ())


def test_cells_read_as_the_legend_says() -> None:
    cell = Cell((("text_encoder", "visits the device for its stage"),
                 ("transformer", "streamed from disk, 3 units resident, built per request"), ("vae", "resident")),
                12.4, None)
    assert cell.short() == "te:V dit:Sd+3L vae:R 12 s"
    assert Cell(None, None, None).short() == "refused"
    with pytest.raises(ValueError, match="no `<!-- plan table: begin"):
        plan_table.replace_in("no markers", "x")

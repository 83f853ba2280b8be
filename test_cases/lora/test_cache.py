"""The parsed-adapter cache (`LoRAManager.read`): an adapter file rewritten in place or replaced by
another file at the same path between two requests is read again, even with the same size and shapes;
an unchanged file is parsed once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save
from torch import nn

from runnerkit.lora import LoRAManager, apply

T0 = 1_700_000_000_000_000_000  # ns; set explicitly, so the filesystem's timestamp granularity plays no part


def _adapter(down: float, up: float) -> dict[str, torch.Tensor]:
    return {"0.lora_down.weight": torch.full((2, 4), down), "0.lora_up.weight": torch.full((3, 2), up)}


def _save(path: Path, down: float, up: float, mtime_ns: int) -> None:
    """Write the file through `open(path, "wb")`: an existing file keeps its inode (cut and rewritten)."""
    path.write_bytes(save(_adapter(down, up)))
    os.utime(path, ns=(mtime_ns, mtime_ns))


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths `read_adapter` parsed, in order (the cache's misses)."""
    seen: list[str] = []
    real = apply.read_adapter

    def spy(path: str):  # noqa: ANN202
        seen.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(apply, "read_adapter", spy)
    return seen


def _request(manager: LoRAManager, lin: nn.Linear, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """One request with the adapter: the slots it wrote (down [2, 4], up [3, 2]), then cleared."""
    manager.set_request([(str(path), 1.0)])
    written = lin.lora_down[:2].clone(), lin.lora_up[:, :2].clone()  # type: ignore[index]
    manager.clear()
    return written


@pytest.mark.parametrize("change", ["rewritten in place", "replaced by rename"])
def test_an_adapter_changed_between_requests_is_read_again(tmp_path: Path, parses: list[str], change: str) -> None:
    """In place: same inode and size, a later mtime. By rename: same size and the very same mtime, another
    inode. Either way the next request writes the new values; the same file again is not parsed again."""
    model = nn.Sequential(nn.Linear(4, 3))
    manager = LoRAManager("unfused", 2, torch.device("cpu"), torch.float32, lambda names: {}, "m")
    manager.attach("transformer", model)
    lin = model[0]
    path = tmp_path / "a.safetensors"
    _save(path, 0.25, 0.5, T0)
    before = os.stat(path)
    assert [t.unique().tolist() for t in _request(manager, lin, path)] == [[0.25], [0.5]]
    assert [t.unique().tolist() for t in _request(manager, lin, path)] == [[0.25], [0.5]]
    assert parses == ["a.safetensors"]  # the second request used the cached parse

    if change == "rewritten in place":
        _save(path, 0.75, -0.5, T0 + 1_000_000)  # one ms later
    else:
        _save(tmp_path / "b.safetensors", 0.75, -0.5, T0)
        os.replace(tmp_path / "b.safetensors", path)
    after = os.stat(path)
    assert after.st_size == before.st_size  # what the test means: only the identity tells the files apart
    assert (after.st_ino == before.st_ino) == (change == "rewritten in place")
    assert (after.st_mtime_ns == before.st_mtime_ns) == (change == "replaced by rename")

    down, up = _request(manager, lin, path)
    assert torch.equal(down, torch.full((2, 4), 0.75)) and torch.equal(up, torch.full((3, 2), -0.5))
    assert parses == ["a.safetensors", "a.safetensors"]

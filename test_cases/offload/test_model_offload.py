"""ModelOffloader: residency tracking, tensors re-bound to one host slab, always moved back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runnerkit.offload import ModelOffloader


def _modules() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    enc.register_buffer("table", torch.arange(6, dtype=torch.float32))
    return {"text_encoder": enc, "vae": nn.Conv2d(2, 3, 3)}


def test_cpu_device_is_a_noop_that_tracks_residency() -> None:
    mods = _modules()
    before = {n: p.data_ptr() for n, p in mods["vae"].named_parameters()}
    off = ModelOffloader(mods, "cpu")
    assert off.resident() == set()
    with off.on_device("vae") as vae:
        assert vae is mods["vae"] and off.resident() == {"vae"}
        with off.on_device("vae"):
            assert off.resident() == {"vae"}
        assert off.resident() == {"vae"}
    assert off.resident() == set()
    assert {n: p.data_ptr() for n, p in mods["vae"].named_parameters()} == before
    with pytest.raises(KeyError, match="'unet' is not an offloaded module; known: \\['text_encoder', 'vae'\\]"):
        with off.on_device("unet"):
            pass


def test_tensors_visit_the_device_and_return_to_the_slab() -> None:
    # device "meta" stands in for CUDA on a CPU-only machine: the copy and re-binding run for real
    mods = _modules()
    enc = mods["text_encoder"]
    originals = {n: t.detach().clone() for n, t in enc.state_dict().items()}
    param_ids = {n: id(p) for n, p in enc.named_parameters()}
    off = ModelOffloader(mods, "meta", pin_memory=False)
    slab = off._slabs["text_encoder"]
    lo, hi = slab.buffer.data_ptr(), slab.buffer.data_ptr() + slab.nbytes
    assert all(lo <= t.data_ptr() < hi for t in enc.state_dict().values())  # packed into one slab
    with pytest.raises(RuntimeError, match="boom"):
        with off.on_device("text_encoder"):
            assert all(t.is_meta for t in enc.state_dict().values())
            assert not mods["vae"].weight.is_meta
            assert off.resident() == {"text_encoder"}
            raise RuntimeError("boom")
    assert off.resident() == set()  # moved back in finally
    assert {n: id(p) for n, p in enc.named_parameters()} == param_ids
    for n, t in enc.state_dict().items():
        assert t.device.type == "cpu" and lo <= t.data_ptr() < hi and torch.equal(t, originals[n])
    off.close()
    with pytest.raises(RuntimeError, match="closed"):
        with off.on_device("vae"):
            pass



def test_packing_rebinds_each_tensor_before_copying_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host peak of packing a module is its slab plus one tensor: each tensor is copied into the slab and every
    use of it re-bound there (its original storage freed) before the next is copied, so a visiting text encoder
    loaded as pageable tensors never sits twice in host memory. A tied tensor is stored and copied once."""
    from runnerkit.offload import model_offload

    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8))
    enc.register_buffer("table", torch.arange(6, dtype=torch.float32))
    enc.tied = enc[0].bias  # the same Parameter under a second name
    values = {n: t.detach().clone() for n, t in enc.state_dict().items()}
    events: list[str] = []
    real_view, real_rebind = model_offload.typed_view, ModelOffloader._rebind

    def view(*args: object) -> torch.Tensor:
        events.append("view")
        return real_view(*args)  # type: ignore[arg-type]

    def rebind(module: nn.Module, leaf: str, is_param: bool, tensor: torch.Tensor) -> None:
        events.append(f"rebind {leaf}")
        real_rebind(module, leaf, is_param, tensor)

    monkeypatch.setattr(model_offload, "typed_view", view)
    monkeypatch.setattr(ModelOffloader, "_rebind", staticmethod(rebind))
    ModelOffloader({"text_encoder": enc}, "meta", pin_memory=False)
    # per stored tensor: its copy's view, then one view + re-bind per use (`module.modules()` order: the root's
    # `tied` first, which is layer 0's bias too; then layer 0's weight, layer 1's weight and bias; the buffer)
    assert events == ["view", "view", "rebind tied", "view", "rebind bias", "view", "view", "rebind weight",
                      "view", "view", "rebind weight", "view", "view", "rebind bias", "view", "view", "rebind table"]
    assert all(torch.equal(t, values[k]) for k, t in enc.state_dict().items())
    assert enc.tied is enc[0].bias

"""What conftest's autouse fixtures promise every test (`isolated_compiler`,
`restored_loguru_sinks`): torch's compiler caches and configs private to a test, loguru's sinks
put back. Each test drives the context managers directly, twice in a row as two tests would, so
none depends on the order the suite runs in."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
from loguru import logger

from test_cases.conftest import isolated_compiler, restored_loguru_sinks


def test_each_block_compiles_into_caches_of_its_own(tmp_path: Path) -> None:
    from torch._inductor.codecache import CacheBase
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    seen = []
    for name in ("a", "b"):
        with isolated_compiler(tmp_path / name):
            seen.append((Path(cache_dir()), CacheBase.get_local_cache_path(), os.environ["TRITON_CACHE_DIR"]))
    for (inductor, local, triton), name in zip(seen, ("a", "b")):
        assert inductor == tmp_path / name / "inductor" and local.is_relative_to(inductor), (inductor, local)
        assert triton == str(tmp_path / name / "triton")


def test_the_vector_isa_is_picked_again_under_each_blocks_config(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """torch memoises the list of usable vector ISAs, and whether AVX-512 is usable, at their first
    use; a vectorised compile in one test must not make a later scalar one (`cpp.vec_isa_ok=False`)
    vectorised, nor a scalar one leave a later test without AVX-512. The C++ probe builds are
    replaced by 'it builds' (this is about what is memoised; their results are dropped after)."""
    from torch._inductor import config, cpu_vec_isa

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda self, code: True)
    remembered = cpu_vec_isa.VecISA._VecISA__bool__impl  # type: ignore[attr-defined]
    remembered.cache_clear()
    try:
        usable = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list.__wrapped__()]  # read afresh, memo untouched
        for name, vec_isa_ok in [("a", False), ("b", None), ("c", False), ("d", None)]:
            with isolated_compiler(tmp_path / name), config.patch({"cpp.vec_isa_ok": vec_isa_ok}):
                picked = cpu_vec_isa.pick_vec_isa()
                assert (str(picked) if picked else None) == (usable[0] if usable and vec_isa_ok is None else None), name
    finally:
        remembered.cache_clear()


def test_compiler_configs_and_the_default_dtype_are_restored(tmp_path: Path) -> None:
    from torch._inductor import config

    before = (config.cpp.vec_isa_ok, config.fx_graph_cache, torch._dynamo.config.cache_size_limit,
              torch.get_default_dtype())
    with isolated_compiler(tmp_path):
        config.cpp.vec_isa_ok = False
        config.fx_graph_cache = not config.fx_graph_cache
        torch._dynamo.config.cache_size_limit += 1
        torch.set_default_dtype(torch.float64)
    assert (config.cpp.vec_isa_ok, config.fx_graph_cache, torch._dynamo.config.cache_size_limit,
            torch.get_default_dtype()) == before


def test_a_sink_left_on_a_closed_stream_is_removed(capsys: pytest.CaptureFixture[str]) -> None:
    """As the launch script's `main` run in-process does: every sink replaced by one on a stream
    that is closed after the test (pytest's capture of it)."""
    stream = io.StringIO()
    with restored_loguru_sinks():
        logger.remove()
        logger.add(stream, level="DEBUG")
    stream.close()
    logger.info("after the test that left its sink")
    err = capsys.readouterr().err
    assert "Logging error" not in err and "closed file" not in err, err
    assert "after the test that left its sink" in err  # the sink put back writes to the stderr of the moment

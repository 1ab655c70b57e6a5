"""The compile cache (`--compile-cache`, executor/placement.py): a compiled stage's graphs persist
in a directory, so a second start, and a replica restarted after its worker died, load them
instead of compiling; each worker's start report (seconds, the cache's hits and misses) reaches
/health and /metrics, with the restart's seconds from the death to ready."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

from tests.conftest import wait_for
from tests.engine.helpers import engine, final, req
from vllm_omni_like.api.metrics import Metrics
from vllm_omni_like.executor import placement


def test_the_compile_cache_dir_is_the_flag_s_else_the_host_s_else_the_cache_dir_s(
    monkeypatch, tmp_path
):
    import torch._inductor.config

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("VLLM_OMNI_LIKE_CACHE", str(tmp_path / "home"))
    # (torch's own patch: pytest's undo of a setattr hides the entry on torch 2.11, and every
    # later torch.compile in the process fails copying the config)
    with torch._inductor.config.patch(fx_graph_cache=False):
        assert placement.share_compile_cache("") == str(tmp_path / "home" / "inductor")
        assert torch._inductor.config.fx_graph_cache  # (torch imported before: set in place)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/host/own")
    assert placement.share_compile_cache("") == "/host/own"
    assert placement.share_compile_cache(str(tmp_path / "flag")) == str(tmp_path / "flag")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "flag")


def _image(eng, pipeline: str, rid: str) -> np.ndarray:
    request = req(rid, "a red circle", pipeline=pipeline, steps=2, seed=5)
    out = asyncio.run(final(eng, request))
    assert out.ok, out.error
    return out.result.images[0].pixels


@pytest.mark.drill
@pytest.mark.timeout(900)
def test_a_second_start_and_a_restarted_replica_load_every_graph_from_the_cache(tmp_path):
    """Real worker processes, inductor on the CPU (a tiny FLUX.1 compiled regionally: a block
    of each kind, one bucket). The first start compiles every graph and saves it; the second
    compiles nothing (every graph a cache hit) and makes the same image; a replica whose worker
    is killed comes back ready from the cache, its restart's seconds in /metrics. The blocks'
    forwards are precompiled: the warm start and the restart load them without a trace."""
    from tests.models.tiny_mmdit import tiny_flux_path

    path = tiny_flux_path()
    pipeline = os.path.basename(path)
    kw = {
        "compile": True,
        "compile_cache": str(tmp_path / "compile-cache"),
        "regional_compile": "on",
        "device": "cpu",
        "max_batch_size": 1,
        "batch_buckets": (1,),
        "load_timeout": 600.0,
    }
    with engine(path, stage_kw=kw) as eng:
        cold = eng.orchestrator.pools[pipeline][0].replicas[0].start
        first = _image(eng, pipeline, "cold")
    assert cold is not None and cold.cache_dir == kw["compile_cache"]
    assert cold.cache_misses > 0 and cold.cache_hits == 0, cold  # (the VAE decoder's graphs)
    assert cold.precompiled == 0 and cold.traced > 0, cold  # the blocks' artifacts saved
    with engine(path, stage_kw=kw) as eng:
        pool = eng.orchestrator.pools[pipeline][0]
        warm = pool.replicas[0].start
        assert warm is not None and warm.cache_misses == 0, warm  # nothing compiled anew
        assert warm.cache_hits == cold.cache_misses
        assert warm.seconds < cold.seconds
        # every block kind's forward loaded precompiled: only the VAE decoder is traced
        assert warm.precompiled > 0 and warm.traced < cold.traced, (warm, cold)
        np.testing.assert_array_equal(_image(eng, pipeline, "warm"), first)
        killed = pool.replicas[0].executor.pids[0]
        os.kill(killed, signal.SIGKILL)
        wait_for(
            lambda: pool.replicas[0].live and pool.replicas[0].executor.pids[0] != killed,
            180,
            "the killed replica to restart",
        )
        again = pool.replicas[0].start
        assert again is not None and again.cache_misses == 0 and again.cache_hits > 0, again
        assert again.precompiled == warm.precompiled and again.traced == warm.traced, again
        restart = pool.replicas[0].restart_seconds
        assert restart is not None and again.seconds <= restart
        np.testing.assert_array_equal(_image(eng, pipeline, "restarted"), first)
        metrics = Metrics(eng).render().decode()
        name = "vllm_omni_like_replica_restart_seconds{"
        line = next(m for m in metrics.splitlines() if m.startswith(name))
        assert 'stage="diffusion"' in line and float(line.split()[-1]) == pytest.approx(restart)
        assert "vllm_omni_like_replica_compile_cache_graphs{" in metrics

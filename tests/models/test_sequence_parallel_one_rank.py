"""The sequence-parallel split over a one-rank group compiles with no graph break (#60 item 5's
first half, on the CPU; its step time against the plain step's is the GPU's to measure:
tests/gpu/test_sequence_parallel_gpu.py). One gloo rank in a process of its own; the tiny
Wan2.1 (tiny-video) and FLUX.1-dev transformers, split (models/<family>/sequence_parallel.py)
and compiled by dynamo with a counting backend (no `fullgraph`: a break would be counted, not
raised): one graph, no break recorded, and the output the plain model's within 1e-5. Over one
rank the exchange is skipped (`SequenceShards`: nothing to exchange); the collectives inside a
compiled graph are the 2- and 4-rank tests' (tests/parallel/test_ulysses.py,
tests/models/test_wan_sequence_parallel.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.models.test_flux_sequence_parallel import _inputs as flux_inputs
from tests.models.tiny_mmdit import tiny_flux_path
from tests.parallel.gloo_ranks import run_ranks
from vllm_omni_like.models.flux.sequence_parallel import split_flux
from vllm_omni_like.models.tiny import ensure_tiny_model
from vllm_omni_like.models.wan.sequence_parallel import split_wan
from vllm_omni_like.parallel.ulysses import SequenceShards

pytestmark = pytest.mark.slow
TOLERANCE = 1e-5


def _wan(path: str) -> tuple[Any, dict[str, Any]]:
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(path, subfolder="transformer").float().eval()
    gen = torch.Generator().manual_seed(1)
    kwargs = {
        "hidden_states": torch.randn(1, model.config.in_channels, 3, 10, 6, generator=gen),
        "timestep": torch.tensor([700.0]),
        "encoder_hidden_states": torch.randn(1, 7, model.config.text_dim, generator=gen),
        "return_dict": False,
    }
    return model, kwargs


def _flux(path: str) -> tuple[Any, dict[str, Any]]:
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(path, subfolder="transformer").float().eval()
    return model, flux_inputs(model, 3, 5, seed=1)


def _compiled_once(rank: int, size: int, paths: dict[str, str]) -> dict[str, tuple]:
    """Each family's split model compiled over this one-rank group: (graphs dynamo made, graph
    breaks it counted, the largest difference from the plain model's output)."""
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    made = {"wan": (_wan, split_wan), "flux": (_flux, split_flux)}
    found = {}
    for family, path in paths.items():
        load, split = made[family]
        model, kwargs = load(path)
        with torch.inference_mode():
            want = model(**kwargs)[0]
            split(model, SequenceShards(rank, size, dist.group.WORLD))
            torch._dynamo.reset()
            counters.clear()
            counter = CompileCounter()
            compiled = torch.compile(model, backend=counter, dynamic=False)
            got = compiled(**kwargs)[0]
            compiled(**kwargs)  # (a second call: no recompile either)
        breaks = sum(counters["graph_break"].values())
        found[family] = (counter.frame_count, breaks, (got - want).abs().max().item())
    return found


@pytest.mark.drill  # (a rank's process and two models traced: 13 s on this machine)
def test_the_split_over_one_rank_compiles_into_one_graph_without_a_break():
    paths = {"wan": ensure_tiny_model("tiny-video"), "flux": tiny_flux_path()}
    (found,) = run_ranks(_compiled_once, 1, paths, timeout=240)
    for family, (graphs, breaks, diff) in found.items():
        assert (graphs, breaks) == (1, 0), (family, graphs, breaks)
        assert diff <= TOLERANCE, (family, diff)

"""CUDA graphs of the denoiser's forward: each compiled bucket's captured once, replayed each step.

The step (step.py) hands every forward to a `GraphRunner` with its inputs as named tensors (the
latents, each model row's timestep, the text - embeddings, masks, a family's named tensors -,
a guidance embedding's scales, rows' own conditioning, each model row's LoRA slots and scales
where the stage has adapters). While the stage warms up, a forward
whose inputs were seen before (the same names, shapes, strides and dtypes: one compiled bucket,
its compiling and autotuning done at the first sight) is captured over static buffers, clones
of those inputs; from then on each such forward copies its inputs into the buffers and replays.
Rows joining and leaving, the padding to the bucket, each row's timestep and its adapters are
only new values in the same buffers: nothing is captured again (the LoRA pool's weights are
written in place into tensors allocated once, lora_pool.py: a replay reads the slots' new
weights). A forward that takes anything but tensors on
the stage's device (Z-Image's token counts kept on the host, an expert chosen by host
timesteps) runs the compiled forward, as does one whose capture failed (a warning says why) and
a shape first seen after the warm-up. The guidance's combination and the row schedulers' update
stay outside: they run on each step's own tensors.

How a graph is captured and replayed is a `GraphBackend`'s: `CudaGraphs` (one memory pool for
every bucket's graph, captured on a side stream) or, in the tests, a double that re-runs the
captured call over the static buffers after poisoning them, so an input not copied in is seen.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import ConfigError

logger = logging.getLogger("vllm_omni_like.stages.diffusion.stage")

Inputs = dict[str, Any]  # a forward's inputs: tensors, named tensors (dicts of them), or None
Key = tuple[Any, ...]  # what one graph is captured for: its inputs' names, shapes, layouts


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphBackend(Protocol):
    """Captures `run` (a forward over static buffers `buffers`) once; returns the graph and
    its static output, which each replay writes again."""

    device: torch.device

    def capture(
        self, run: Callable[[], torch.Tensor], buffers: dict[str, torch.Tensor]
    ) -> tuple[Graph, torch.Tensor]: ...

    def memory(self) -> int:
        """Bytes its graphs hold (their pool)."""
        ...


class CudaGraphs:
    """Real CUDA graphs: every bucket's in one memory pool, captured on a side stream after a
    run there (lazy initialisations: cuBLAS's workspace)."""

    def __init__(self, device: torch.device) -> None:
        if device.index is None:  # ("cuda" names the current one; its tensors say "cuda:N")
            device = torch.device(device.type, torch.cuda.current_device())
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.held = 0  # bytes the captures added to the allocator's reserve

    def capture(
        self, run: Callable[[], torch.Tensor], buffers: dict[str, torch.Tensor]
    ) -> tuple[Graph, torch.Tensor]:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # (as the capture's start does: what stays reserved is its pool)
        before = torch.cuda.memory_reserved(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            run()
        graph, current = torch.cuda.CUDAGraph(), torch.cuda.current_stream(self.device)
        rng = torch.cuda.default_generators[self.device.index or 0]
        before_capture = rng.clone_state()
        try:  # thread_local: the finisher thread's decode on its own stream is no part of it
            with torch.cuda.graph(
                graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
            ):
                output = run()
        except BaseException:
            # A capture that fails never ends the device generator's capture (its epilogue
            # runs after the end succeeds): every later random draw on the device would fail
            # ("Offset increment outside graph capture", seen on an H100). Its state before.
            rng.graphsafe_set_state(before_capture)
            raise
        finally:  # (a capture that fails to end leaves its stream current: not this thread's)
            torch.cuda.set_stream(current)
        current.wait_stream(self.stream)
        self.held += max(0, torch.cuda.memory_reserved(self.device) - before)
        return graph, output

    def memory(self) -> int:
        return self.held


@dataclass
class Captured:
    graph: Graph
    buffers: dict[str, torch.Tensor]  # the static inputs, by name
    output: torch.Tensor  # the static output
    label: str  # the bucket, as /health names it: the latents' shape


class GraphRunner:
    """A stage's graphs, one a bucket; without a backend, every forward runs as it is."""

    def __init__(self, backend: GraphBackend | None = None, stage: str = "diffusion") -> None:
        self.backend = backend
        self.stage = stage
        self.graphs: dict[Key, Captured] = {}
        self.seen: set[Key] = set()  # forwards run once (compiled, autotuned) while warming up
        self.failed: set[Key] = set()  # whose capture failed: the compiled forward runs them
        self.warming = False
        self.replays = 0

    @contextlib.contextmanager
    def warm_up(self) -> Iterator[None]:
        """While the stage warms up, a forward seen a second time is captured."""
        self.warming = True
        try:
            yield
        finally:
            self.warming = False

    def labels(self) -> tuple[str, ...]:
        """The buckets with a graph (/health)."""
        return tuple(sorted({c.label for c in self.graphs.values()}))

    def memory(self) -> int:
        return 0 if self.backend is None else self.backend.memory()

    def forward(
        self, inputs: Inputs, call: Callable[[Inputs], Any], replayable: bool = True
    ) -> Any:
        """`call(inputs)`: replayed from its bucket's graph where there is one (its output a
        tensor of its own), captured now where the warm-up sees it again, else run."""
        flat = self._flat(inputs) if self.backend is not None and replayable else None
        if flat is None:
            return call(inputs)
        key = tuple((name, t.shape, t.stride(), t.dtype) for name, t in flat.items())
        captured = self.graphs.get(key)
        if captured is None:
            if not self.warming or key not in self.seen or key in self.failed:
                self.seen.add(key)
                return call(inputs)
            captured = self._capture(key, inputs, flat, call)
            if captured is None:
                return call(inputs)
        self._copy_in(captured.buffers, flat)
        captured.graph.replay()
        self.replays += 1
        return captured.output.clone()

    def _copy_in(self, buffers: dict[str, torch.Tensor], flat: dict[str, torch.Tensor]) -> None:
        """This forward's inputs into the graph's static buffers (every one, every step)."""
        for name, value in flat.items():
            buffers[name].copy_(value, non_blocking=True)

    def _flat(self, inputs: Inputs) -> dict[str, torch.Tensor] | None:
        """The inputs' tensors by name; None where one is not a tensor on the device."""
        flat: dict[str, torch.Tensor] = {}
        if not _flatten(inputs, "", flat):
            return None
        assert self.backend is not None
        device = self.backend.device
        if any(t.device != device for t in flat.values()):
            return None
        return flat

    def _capture(
        self,
        key: Key,
        inputs: Inputs,
        flat: dict[str, torch.Tensor],
        call: Callable[[Inputs], Any],
    ) -> Captured | None:
        assert self.backend is not None
        buffers = {name: t.clone() for name, t in flat.items()}
        static = _rebuild(inputs, "", buffers)
        try:
            graph, output = self.backend.capture(lambda: call(static), buffers)
            if not isinstance(output, torch.Tensor):
                raise TypeError(f"the forward returned {type(output).__name__}, not a tensor")
        except Exception as exc:
            self.failed.add(key)
            logger.warning(
                "stage %s: the CUDA graph of the forward %s failed (%s: %s); it runs the "
                "compiled forward",
                self.stage,
                _label(flat),
                type(exc).__name__,
                exc,
            )
            return None
        captured = Captured(graph, buffers, output, _label(flat))
        self.graphs[key] = captured
        return captured


def _flatten(value: Any, name: str, out: dict[str, torch.Tensor]) -> bool:
    if value is None:
        return True
    if isinstance(value, torch.Tensor):
        out[name] = value
        return True
    if isinstance(value, dict):
        return all(_flatten(v, f"{name}.{k}" if name else str(k), out) for k, v in value.items())
    return False


def _rebuild(value: Any, name: str, buffers: dict[str, torch.Tensor]) -> Any:
    """`value`'s structure with each tensor replaced by its static buffer."""
    if isinstance(value, torch.Tensor):
        return buffers[name]
    if isinstance(value, dict):
        named = {k: (v, f"{name}.{k}" if name else str(k)) for k, v in value.items()}
        return {k: _rebuild(v, path, buffers) for k, (v, path) in named.items()}
    return value


def _label(flat: dict[str, torch.Tensor]) -> str:
    return "x".join(str(d) for d in flat["latents"].shape)


def backend_for(config: StageConfig, device: torch.device) -> GraphBackend | None:
    """The graphs a stage captures (`--cuda-graphs`; its start-up checks are config.py's):
    CUDA's, or none. `on` on a device without CUDA is refused here, where the device is known."""
    if config.cuda_graphs == "on" and device.type != "cuda":
        raise ConfigError(f"stage {config.name!r}: --cuda-graphs on needs CUDA, not {device}")
    if config.cuda_graphs == "off" or not config.compile or config.leads:
        return None
    if config.cache != "none":  # (auto: a step cache decides between the blocks, eager)
        return None
    return CudaGraphs(device) if device.type == "cuda" else None

"""What crosses a process boundary: the parent's orders to a stage's workers and the workers'
reports, pickled over the workers' pipes (multiproc) or Ray's object store. Data only: no live
object (a lock, a thread, an executor) rides here; receivers `match` on type. The executor's
report of a lost worker (`ReplicaDied`) travels the same sink as the workers' reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from vllm_omni_like.errors import ErrorInfo
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.params import GenerationParams

# ---- what a stage is asked to do ---------------------------------------------------------------


class Mode(StrEnum):
    """What a stage makes of a request (pipelines/base.py picks it). A `str`: it equals, hashes,
    formats and serializes as its value, so strings written before it (a pickle, a test's
    `mode="edit"`) still compare equal."""

    TEXT = "text"  # an LLM stage's (or a null stage's that writes text)
    TEXT2IMG = "text2img"
    EDIT = "edit"  # an image from an image (img2img, inpaint, an instruction)
    TEXT2VIDEO = "text2video"
    IMAGE2VIDEO = "image2video"
    # an EDIT with a mask as the loops route it (`StageRequest.loop_mode`; sent as EDIT)
    INPAINT = "inpaint"


@dataclass
class StageRequest:
    """One request as one stage sees it."""

    request_id: str
    prompt: str
    params: GenerationParams = field(default_factory=GenerationParams)
    mode: Mode = Mode.TEXT2IMG
    images: list[Any] = field(default_factory=list)  # HxWx3 uint8 arrays (edit inputs)
    mask: Any | None = None  # HxW uint8, 255 = repaint (diffusers' convention)
    # a prompt written by an earlier stage is truncated to the encoder, not refused
    truncate_prompt: bool = False
    client_id: str | None = None  # the client's x-request-id (logs, fault selection)
    files_only: bool = False  # see inputs.OmniRequest.files_only
    encodes_png: bool = False  # see inputs.OmniRequest.encodes_png

    def __post_init__(self) -> None:
        self.mode = Mode(self.mode)  # a mode given as its string is the member (or refused)

    @property
    def loop_mode(self) -> Mode:
        """The mode that picks its loop and shape group: an edit with a mask inpaints."""
        return Mode.INPAINT if self.mode == Mode.EDIT and self.mask is not None else self.mode

    def batch_key(self, own_loop: frozenset[Mode] = frozenset()) -> tuple[Any, ...]:
        """Equal keys may share a batch. In a mode our own loop runs (`own_loop`) each row has
        its own steps, guidance, scheduler and seed: only the shapes count. An image-to-image
        edit of a size given shares text-to-image's rows (the denoiser's input is the same:
        only its start differs), and a video from a first frame text-to-video's where our loop
        runs both (Wan2.2-TI2V: the frame put back in the same latents); an edit by
        instruction (no text-to-image beside it) or of the upload's size keys on the upload's
        shape too (its sequence's length: the upload's fit depends on its shape only)."""
        mode, p = self.loop_mode, self.params
        if mode in own_loop:  # (text rows of any length share a step)
            if mode == Mode.TEXT:
                return (mode,)
            key = (mode, p.width, p.height, p.num_frames)
            if mode == Mode.IMAGE2VIDEO and Mode.TEXT2VIDEO in own_loop:
                return (Mode.TEXT2VIDEO, *key[1:])
            if mode == Mode.INPAINT and not (p.width and p.height):  # (its upload's size)
                return (*key, tuple(self.images[0].shape[:2]) if self.images else None)
            if mode != Mode.EDIT:
                return key
            if Mode.TEXT2IMG in own_loop and p.width and p.height:
                return (Mode.TEXT2IMG, *key[1:])
            return (*key, tuple(self.images[0].shape[:2]) if self.images else None)
        if self.mode == Mode.IMAGE2VIDEO:  # one image a call (the pipeline encodes one)
            return (*self.params.shape_key(self.mode), self.request_id)
        if self.mode != Mode.EDIT:
            return self.params.shape_key(self.mode)
        shape = tuple(self.images[0].shape[:2]) if self.images else None
        return (*self.params.shape_key(self.mode), shape, self.mask is not None)


# ---- parent -> worker ----------------------------------------------------------------------------


@dataclass
class ExecuteBatch:
    batch_id: int
    requests: list[StageRequest]


@dataclass
class FollowBatch:
    """To a CFG-parallel replica's rank 1: serve rank 0's denoiser calls for this batch (rank 0
    ends it). Between batches rank 1 waits on its pipe, where no collective can time out."""

    batch_id: int


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


# ---- worker -> parent ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StartReport:
    """What a worker's start took and found (a compiled stage's: its compile cache, its CUDA
    graphs); /health and /metrics show rank 0's per replica."""

    seconds: float  # the load, compile and warm-up
    cache_dir: str = ""  # where compiled graphs persist ("": not compiled)
    cache_hits: int = 0  # compiled graphs loaded from it (inductor's FX graph cache)
    cache_misses: int = 0  # compiled anew (and saved to it)
    graphs: tuple[str, ...] = ()  # the buckets whose forward replays a CUDA graph
    graph_bytes: int = 0  # what their memory pool holds
    precompiled: int = 0  # forwards loaded precompiled from it: no trace (precompiled.py)
    traced: int = 0  # graphs dynamo traced at this start (0: every forward precompiled)


@dataclass(frozen=True)
class OffloadReport:
    """A stage's `--offload idle-expert` (stages/diffusion/offload.py): /health and /metrics say
    rank 0's per replica, from its start and each BatchDone."""

    mode: str
    resident: str | None  # the expert on the device (None: a swap failed, none is)
    swaps: int
    last_swap_s: float | None  # the copy stream's time of the last swap (None: none measured)
    device_bytes: int  # the experts' weights on the device (one expert, and a prefetch)
    host_bytes: int  # both experts' masters in host memory


@dataclass
class WorkerReady:
    rank: int
    pid: int
    device: str  # as the worker names it (cuda:0 where it sees only its own GPU)
    visible_devices: str | None = None  # its CUDA_VISIBLE_DEVICES
    gpu_memory: int = 0  # bytes its CUDA allocator holds once loaded
    # the modes whose rows join and leave its running set at step boundaries (Stage.stepper)
    stepped: tuple[Mode, ...] = ()
    precision: str | None = None  # what its model computes in (Stage.precision): fp8, bf16...
    start: StartReport | None = None
    offload: OffloadReport | None = None  # its idle expert's offload (Stage.offload)


@dataclass
class WorkerLoadFailed:
    rank: int
    error: ErrorInfo
    traceback: str = ""


@dataclass
class Progress:
    """Step `step` of `total` finished for these requests (those not aborted); `progress`:
    each request's own (step, total) where rows run their own step counts (the batch's step
    is its loop's, `total` its longest row's)."""

    batch_id: int
    request_ids: list[str]
    step: int
    total: int
    previews: dict[str, Any] = field(default_factory=dict)  # request id -> HxWx3 uint8
    progress: dict[str, tuple[int, int]] | None = None
    # a running set: the other groups (their ExecuteBatch ids) that stepped with `batch_id`'s
    joined: list[int] = field(default_factory=list)


@dataclass
class Compiling:
    """Rank `rank` of the replica compiles now (`active`), or has stopped: a step that waits on a
    compile may take the stage's compile timeout instead of its stall bound."""

    active: bool
    rank: int = 0


@dataclass
class Held:
    """The group waits at the worker: its running set has no room for it now (the running-set
    policy, executor/join_policy.py; only a group sent ahead, `--replica-queue`, ever does). It
    starts when a `Progress` names it."""

    batch_id: int


@dataclass
class Denoised:
    """The batch left the critical path: its rest (decode) runs beside the next batch, whose
    ExecuteBatch the worker may take now; its results and BatchDone follow."""

    batch_id: int


@dataclass
class RequestResult:
    batch_id: int
    output: StageOutput


@dataclass
class BatchDone:
    batch_id: int
    batch_size: int
    model_batch_dim: int  # the largest batch dimension the model itself saw
    elapsed_s: float
    steps_run: dict[str, int] = field(default_factory=dict)  # aborted requests included
    # for requests aborted while in this batch: steps the worker ran after the abort reached it
    steps_after_abort: dict[str, int] = field(default_factory=dict)
    gpu_memory: int = 0  # bytes the worker's CUDA allocator holds after the batch
    # seconds of its parts: "denoise" (the critical path, `begin`) and "finish" (the decode)
    phases: dict[str, float] = field(default_factory=dict)
    offload: OffloadReport | None = None  # its idle expert's offload after the batch


# ---- the executor -> its owner (its reader / monitor threads) ----------------------------


@dataclass
class ReplicaDied:
    """The executor of `replica` lost a worker: the replica is dead (its other workers killed,
    new work refused) and `in_flight` lists the requests lost with it, for which no result will
    come; the orchestrator fails or re-queues each (engine/deaths.py)."""

    stage: str
    replica: int
    exit_desc: str
    in_flight: list[str] = field(default_factory=list)


# the parent's orders to a worker, and what comes back on the executor's sink
ToWorker = ExecuteBatch | FollowBatch | AbortRequests | Shutdown
FromWorker = (
    WorkerReady
    | WorkerLoadFailed
    | Progress
    | Compiling
    | Denoised
    | Held
    | RequestResult
    | BatchDone
    | ReplicaDied
)

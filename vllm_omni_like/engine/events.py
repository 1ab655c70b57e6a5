"""The orchestrator's inbox: the in-process events its thread takes, some carrying live objects
(a request's state, a restarted replica's executor). They never cross a process boundary (the
workers' messages, wrapped in `FromReplica`, are `wire`'s)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_omni_like.engine.request_state import RequestState
from vllm_omni_like.errors import ErrorInfo, ErrorKind
from vllm_omni_like.executor.base import Executor
from vllm_omni_like.wire import FromWorker


@dataclass
class FromReplica:
    """A worker message (or a ReplicaDied), tagged with where it came from."""

    pipeline: str
    stage: int
    replica: int
    msg: FromWorker


@dataclass
class Submit:
    state: RequestState


@dataclass
class Abort:
    request_id: str
    kind: ErrorKind = ErrorKind.ABORTED  # one of errors.ABORT_KINDS


@dataclass
class ReplicaRestarted:
    pipeline: str
    stage: int
    replica: int
    executor: Executor


@dataclass
class ReplicaRestartFailed:
    pipeline: str
    stage: int
    replica: int
    error: ErrorInfo
    lacked_room: bool = False  # descriptors or memory ran out: not the model's fault


@dataclass
class CutOff:
    """The drain timeout passed: every request still in the engine ends now (503)."""

    message: str


@dataclass
class StopOrchestrator:
    pass


# what the orchestrator's inbox carries
InboxEvent = (
    FromReplica
    | Submit
    | Abort
    | ReplicaRestarted
    | ReplicaRestartFailed
    | CutOff
    | StopOrchestrator
)

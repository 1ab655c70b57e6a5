"""Per-request isolation: a batch that raises is bisected until only the culprit fails."""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Callable
from typing import TypeVar

from vllm_omni_like.errors import (
    EngineGenerateError,
    FatalStageError,
    InvalidRequestError,
    OmniError,
    is_fatal_device_error,
    is_out_of_memory,
)
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.stages.base import Deferred, Stage, StageAborted, StageControl
from vllm_omni_like.wire import StageRequest

logger = logging.getLogger(__name__)
T = TypeVar("T")


def free_device_cache() -> None:
    torch = sys.modules.get("torch")  # never import torch just for this
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def release_failed_memory(exc: BaseException) -> None:
    """After an out-of-memory error, once its `except` block is left: the failed call's frames
    (its tensors) hang on the traceback, so drop it, collect what it held, and give the freed
    blocks back to the device. Emptied only here, never after every batch."""
    exc.__traceback__ = None
    exc.__context__ = exc.__cause__ = None
    gc.collect()
    free_device_cache()


def _as_request_error(exc: BaseException, stage: str) -> OmniError:
    if isinstance(exc, OmniError):
        return exc
    if is_out_of_memory(exc):
        return EngineGenerateError(f"out of memory while running this request: {exc}", stage=stage)
    return EngineGenerateError(f"{type(exc).__name__}: {exc}", stage=stage)


Report = Callable[[StageOutput], None] | None


def _bisect(
    stage: str,
    batch: list[StageRequest],
    control: StageControl,
    run: Callable[[list[StageRequest]], list[T]],
    report: Report = None,
) -> list[T | StageOutput]:
    """`run(live)` over the live requests of `batch`; on failure re-run halves, so only the
    culprit gets the error (O(log B) extra calls); a fatal device error raises FatalStageError.

    With `report`, a culprit's error goes out through it the moment it is known, not after
    the re-runs of its innocent neighbours."""
    live = control.live(batch)
    if not live:
        return []
    try:
        return [*run(live)]
    except StageAborted:
        return []
    except FatalStageError:  # raised as such (a CFG-parallel rank's link broke): the worker's
        raise
    except Exception as failure:
        if is_fatal_device_error(failure):
            raise FatalStageError(str(failure)) from failure
        exc = failure
    if is_out_of_memory(exc):
        release_failed_memory(exc)
    if len(live) == 1:
        if not isinstance(exc, InvalidRequestError):
            logger.warning("stage %s: request %s failed: %r", stage, live[0].request_id, exc)
        err = StageOutput.from_error(live[0].request_id, _as_request_error(exc, stage), stage)
        if report is None:
            return [err]
        report(err)
        return []
    logger.info("stage %s: batch of %d raised %r; bisecting", stage, len(live), exc)
    mid = len(live) // 2
    return _bisect(stage, live[:mid], control, run, report) + _bisect(
        stage, live[mid:], control, run, report
    )


def _retried_after_reclaim(
    stage: str, control: StageControl, run: Callable[[list[StageRequest]], list[T]]
) -> Callable[[list[StageRequest]], list[T]]:
    """`run`, which on its first out-of-memory error while the batch before is being finished
    beside it waits for that memory to come back and runs once more: nobody's fault, so no
    bisection and no error."""
    retried = False

    def once_more(live: list[StageRequest]) -> list[T]:
        nonlocal retried
        try:
            return run(live)
        except Exception as failure:
            if retried or not is_out_of_memory(failure) or control.reclaim is None:
                raise
            exc = failure
        retried = True
        if not control.reclaim():  # nothing was held beside it: the batch's own doing
            raise exc
        logger.warning(
            "stage %s: out of memory while the batch before decoded (%s); its memory is back, "
            "running the batch of %d again",
            stage,
            exc,
            len(live),
        )
        release_failed_memory(exc)
        del exc
        return run(control.live(live))

    return once_more


def bisect_isolated(
    stage: str,
    batch: list[StageRequest],
    control: StageControl,
    run: Callable[[list[StageRequest]], list[StageOutput]],
    report: Report,
) -> list[StageOutput]:
    """`run` over `batch`, halves re-run on failure until only the culprits fail (each
    reported); an out-of-memory error while a batch is finished beside it is retried once."""
    return _bisect(stage, batch, control, _retried_after_reclaim(stage, control, run), report)


def begin_isolated(
    stage: Stage, batch: list[StageRequest], control: StageControl, report: Report = None
) -> list[Deferred | StageOutput]:
    """The critical-path part of `batch` (`begin`): Deferred parts, and errors of culprits."""

    def begin(live: list[StageRequest]) -> list[Deferred]:
        control.faults.fire("execute", live)  # here, so that no stage can forget it
        return [stage.begin(live, control)]

    run = _retried_after_reclaim(stage.name, control, begin)
    return _bisect(stage.name, batch, control, run, report)


def finish_isolated(
    stage: Stage, part: Deferred, control: StageControl, report: Report = None
) -> list[StageOutput]:
    """The deferred rest of a part (aborted requests skipped), each failure confined likewise."""

    def run(live: list[StageRequest]) -> list[StageOutput]:
        outputs = part.finish(live)
        control.faults.fire("output", live)
        return outputs

    return _bisect(stage.name, part.requests, control, run, report)


def finish_parts(
    stage: Stage, parts: list[Deferred | StageOutput], control: StageControl, report: Report = None
) -> list[StageOutput]:
    """The outputs of begun parts: each deferred part finished (isolated), errors as they are."""
    outputs: list[StageOutput] = []
    for part in parts:
        if isinstance(part, StageOutput):
            outputs.append(part)
        else:
            outputs.extend(finish_isolated(stage, part, control, report))
    return outputs


def run_isolated(
    stage: Stage, batch: list[StageRequest], control: StageControl, report: Report = None
) -> list[StageOutput]:
    """The whole of `batch` (begin, then finish), each failure confined to its culprit."""
    return finish_parts(stage, begin_isolated(stage, batch, control, report), control, report)

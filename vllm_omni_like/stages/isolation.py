"""Per-request isolation: a batch that raises is bisected until only the culprit fails."""

from __future__ import annotations

import logging
import sys

from vllm_omni_like.errors import EngineGenerateError, InvalidRequestError, OmniError
from vllm_omni_like.messages import StageRequest
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.stages.base import Stage, StageAborted, StageControl

logger = logging.getLogger(__name__)


class FatalStageError(Exception):
    """The device is unusable (a CUDA error other than out-of-memory): the worker must exit."""


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


def is_fatal_device_error(exc: BaseException) -> bool:
    if is_out_of_memory(exc):
        return False
    text = str(exc)
    return type(exc).__name__ == "AcceleratorError" or "CUDA error" in text or "CUBLAS_" in text


def free_device_cache() -> None:
    torch = sys.modules.get("torch")  # never import torch just for this
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _as_request_error(exc: BaseException, stage: str) -> OmniError:
    if isinstance(exc, OmniError):
        return exc
    if is_out_of_memory(exc):
        return EngineGenerateError(f"out of memory while running this request: {exc}", stage=stage)
    return EngineGenerateError(f"{type(exc).__name__}: {exc}", stage=stage)


def run_isolated(
    stage: Stage, batch: list[StageRequest], control: StageControl
) -> list[StageOutput]:
    """Run `batch`; on failure re-run halves, so only the culprit gets the error (O(log B))."""
    live = control.live(batch)
    if not live:
        return []
    try:
        outputs = stage.execute(live, control)
        control.faults.fire("output", live)
        return outputs
    except StageAborted:
        return []
    except Exception as exc:
        if is_fatal_device_error(exc):
            raise FatalStageError(str(exc)) from exc
        if is_out_of_memory(exc):
            free_device_cache()
        if len(live) == 1:
            if not isinstance(exc, InvalidRequestError):
                logger.warning(
                    "stage %s: request %s failed: %r", stage.name, live[0].request_id, exc
                )
            return [
                StageOutput.from_error(
                    live[0].request_id, _as_request_error(exc, stage.name), stage.name
                )
            ]
        logger.info("stage %s: batch of %d raised %r; bisecting", stage.name, len(live), exc)
        mid = len(live) // 2
        return run_isolated(stage, live[:mid], control) + run_isolated(stage, live[mid:], control)

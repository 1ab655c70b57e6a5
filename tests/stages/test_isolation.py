import math
import weakref

import pytest

from tests.stage_helpers import CountingStage, DeviceErrorStage
from vllm_omni_like.config import FaultRule, StageConfig
from vllm_omni_like.errors import ErrorKind, FatalStageError
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.stages.isolation import run_isolated
from vllm_omni_like.wire import StageRequest


def _stage(cls=CountingStage):
    stage = cls(StageConfig(name="diffusion", kind="null"))
    stage.load("cpu")
    return stage


def _batch(prompts):
    return [
        StageRequest(f"r{i}", p, GenerationParams(seed=i, num_inference_steps=2))
        for i, p in enumerate(prompts)
    ]


def _control(rules=()):
    return StageControl(FaultInjector(rules, "diffusion"))


def test_bisection_fails_only_the_culprit_in_log_time():
    CountingStage.calls = []
    batch = _batch(["ok"] * 5 + ["@bad"] + ["ok"] * 2)
    outs = run_isolated(_stage(), batch, _control())
    by_id = {o.request_id: o for o in outs}
    assert set(by_id) == {r.request_id for r in batch}
    assert by_id["r5"].error is not None
    assert by_id["r5"].error.message == "stage 'diffusion': ValueError: bad input in batch"
    assert by_id["r5"].error.status == 500
    assert all(
        by_id[f"r{i}"].error is None and by_id[f"r{i}"].images for i in (0, 1, 2, 3, 4, 6, 7)
    )
    # the full batch, then two halves per level: at most 1 + 2*log2(B) runs
    assert len(CountingStage.calls) <= 1 + 2 * math.log2(len(batch))


def test_out_of_memory_is_bisected_and_reported_as_generate_error():
    outs = run_isolated(_stage(), _batch(["ok", "@oom", "ok"]), _control())
    errs = {o.request_id: o.error for o in outs}
    assert errs["r0"] is None and errs["r2"] is None
    assert errs["r1"].kind is ErrorKind.GENERATE
    assert "out of memory" in errs["r1"].message


def test_injected_invalid_fault_becomes_invalid_request_for_its_request_only():
    rules = [FaultRule("diffusion", "step", "invalid", match="@inv")]
    outs = run_isolated(_stage(), _batch(["a", "b @inv", "c", "d"]), _control(rules))
    errs = {o.request_id: o.error for o in outs}
    assert errs["r1"].status == 400 and errs["r1"].stage == "diffusion"
    assert [errs[k] for k in ("r0", "r2", "r3")] == [None, None, None]


def test_output_point_fault_is_isolated_too():
    rules = [FaultRule("diffusion", "output", "raise", match="@out")]
    outs = run_isolated(_stage(), _batch(["a", "b", "c @out"]), _control(rules))
    assert [o.error is None for o in outs] == [True, True, False]


def test_device_error_is_fatal_not_bisected():
    with pytest.raises(FatalStageError, match="illegal memory access"):
        run_isolated(_stage(DeviceErrorStage), _batch(["a", "device-error"]), _control())


def test_an_error_that_ends_the_worker_is_not_a_request_error():
    """A CFG-parallel rank whose peer died raises FatalStageError itself: never bisected into
    request errors (their requests must re-run once the replica restarts)."""
    with pytest.raises(FatalStageError, match="Connection reset by peer"):
        run_isolated(_stage(DeviceErrorStage), _batch(["a", "link-broken"]), _control())


def test_aborted_requests_are_skipped():
    control = _control()
    control.abort(["r0", "r1"])
    assert run_isolated(_stage(), _batch(["a", "b"]), control) == []


class _Held:
    """Stands for the tensors of a forward that ran out of memory."""


def test_after_out_of_memory_the_failed_calls_memory_is_gone_before_the_cache_is_emptied(
    monkeypatch,
):
    """The failed call's frames hang on the exception's traceback: the device's cache is
    emptied only once they are gone, else the blocks they hold would stay reserved."""
    from vllm_omni_like.stages import isolation

    refs: list[weakref.ref] = []
    alive_at_empty: list[bool] = []

    def forward(live):
        activations = _Held()  # a local of the failed call's frame
        refs.append(weakref.ref(activations))
        raise MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(
        isolation, "free_device_cache", lambda: alive_at_empty.append(refs[-1]() is not None)
    )
    outs = isolation._bisect("diffusion", _batch(["a", "b"]), _control(), forward)
    assert [o.error.code for o in outs] == ["generation_failed"] * 2
    assert "out of memory while running this request" in outs[0].error.message
    assert len(alive_at_empty) == 3  # the batch, then each half alone
    assert alive_at_empty == [False, False, False]

import pickle

import pytest

from vllm_omni_like import errors
from vllm_omni_like.errors import (
    EngineDeadError,
    EngineGenerateError,
    InvalidRequestError,
    QueueFullError,
    classify,
)
from vllm_omni_like.outputs import OmniRequestOutput, StageOutput

TABLE = [
    (errors.InvalidRequestError, 400, "invalid_request_error", True),
    (errors.AuthenticationError, 401, "invalid_request_error", True),
    (errors.NotFoundError, 404, "invalid_request_error", True),
    (errors.ConflictError, 409, "invalid_request_error", True),
    (errors.PayloadTooLargeError, 413, "invalid_request_error", True),
    (errors.QueueFullError, 429, "rate_limit_error", True),
    (errors.EngineGenerateError, 500, "server_error", True),
    (errors.EngineDeadError, 503, "service_unavailable", False),
    (errors.RequestTimeoutError, 504, "timeout_error", True),
]


@pytest.mark.parametrize(("cls", "status", "etype", "recoverable"), TABLE)
def test_taxonomy_fixes_status_type_and_recoverability(cls, status, etype, recoverable):
    exc = cls("boom", stage="diffusion")
    assert isinstance(exc, errors.OmniError)
    info = exc.info()
    assert (info.status, info.type, info.recoverable) == (status, etype, recoverable)
    assert info.message == "stage 'diffusion': boom"
    assert info.stage == "diffusion"
    assert info.code


@pytest.mark.parametrize(("cls", "status", "etype", "recoverable"), TABLE)
def test_message_is_never_empty(cls, status, etype, recoverable):
    assert cls("").message == f"{cls.__name__} (no detail given)"
    assert cls("   ").info().message


def test_errors_survive_pickling_with_their_fields():
    exc = QueueFullError("too much waiting", code="queue_full", retry_after=2.0, param="model")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is QueueFullError
    assert (back.message, back.code, back.retry_after, back.param) == (
        "too much waiting",
        "queue_full",
        2.0,
        "model",
    )


def test_info_round_trips_to_the_same_class():
    info = EngineDeadError("gone", stage="llm").info()
    again = info.to_exception()
    assert type(again) is EngineDeadError
    assert again.message == "stage 'llm': gone"


def test_classify_wraps_foreign_exceptions_as_recoverable_generate_errors():
    err = classify(KeyError("x"), "diffusion")
    assert isinstance(err, EngineGenerateError)
    assert err.message == "stage 'diffusion': KeyError: 'x'"
    assert classify(ValueError(), None).message == "ValueError: ValueError"


def test_classify_keeps_taxonomy_errors_and_adds_the_stage():
    err = classify(InvalidRequestError("bad size", param="size"), "diffusion")
    assert isinstance(err, InvalidRequestError)
    assert err.stage == "diffusion" and err.param == "size"
    assert "stage 'diffusion'" in err.message


def test_request_output_from_error():
    out = OmniRequestOutput.from_error("req-1", RuntimeError("kaput"), "diffusion")
    assert not out.ok
    assert out.error.error_class == "EngineGenerateError"
    assert out.error.status == 500
    assert out.error.message == "stage 'diffusion': RuntimeError: kaput"
    assert OmniRequestOutput("req-2").ok
    stage_out = StageOutput.from_error("req-3", EngineDeadError("dead"), "llm")
    assert stage_out.error.recoverable is False


def test_light_modules_do_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys; import vllm_omni_like, vllm_omni_like.messages, vllm_omni_like.config, "
        "vllm_omni_like.outputs, vllm_omni_like.errors, vllm_omni_like.executor, "
        "vllm_omni_like.stages.null; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

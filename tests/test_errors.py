import pickle

import pytest

from vllm_omni_like import errors
from vllm_omni_like.engine.request_state import FINAL_STATUSES
from vllm_omni_like.errors import (
    EngineDeadError,
    EngineGenerateError,
    ErrorInfo,
    ErrorKind,
    InvalidRequestError,
    QueueFullError,
    classify,
)
from vllm_omni_like.outputs import OmniRequestOutput, StageOutput

TABLE = [
    (errors.InvalidRequestError, 400, "invalid_request_error", True, "invalid"),
    (errors.AuthenticationError, 401, "invalid_request_error", True, "invalid"),
    (errors.NotFoundError, 404, "invalid_request_error", True, "invalid"),
    (errors.ClientTimeoutError, 408, "invalid_request_error", True, "invalid"),
    (errors.ConflictError, 409, "invalid_request_error", True, "invalid"),
    (errors.PayloadTooLargeError, 413, "invalid_request_error", True, "invalid"),
    (errors.QueueFullError, 429, "rate_limit_error", True, "invalid"),
    (errors.AbortedError, 499, "invalid_request_error", True, "aborted"),
    (errors.EngineGenerateError, 500, "server_error", True, "error"),
    (errors.StorageError, 500, "server_error", True, "error"),
    (errors.UnavailableError, 503, "service_unavailable", True, "error"),
    (errors.ShuttingDownError, 503, "service_unavailable", True, "aborted"),
    (errors.EngineDeadError, 503, "service_unavailable", False, "dead"),
    (errors.RequestTimeoutError, 504, "timeout_error", True, "timeout"),
]


@pytest.mark.parametrize(("cls", "status", "etype", "recoverable", "final"), TABLE)
def test_each_kind_fixes_status_type_recoverability_and_final_status(
    cls, status, etype, recoverable, final
):
    exc = cls("boom", stage="diffusion")
    assert isinstance(exc, errors.OmniError)
    info = exc.info
    assert info.kind is cls.kind
    assert (info.status, info.type, info.recoverable, info.final_status) == (
        status,
        etype,
        recoverable,
        final,
    )
    assert info.message == "stage 'diffusion': boom" == exc.message == str(exc)
    assert info.stage == "diffusion"
    assert info.code == cls.kind.value.code


def test_every_kind_is_distinct_and_only_dead_is_fatal():
    assert len({k.value for k in ErrorKind}) == len(ErrorKind)
    assert [k for k in ErrorKind if not k.value.recoverable] == [ErrorKind.DEAD]
    assert FINAL_STATUSES[0] == "success"
    assert set(FINAL_STATUSES[1:]) == {k.value.final for k in ErrorKind}


@pytest.mark.parametrize("cls", [row[0] for row in TABLE])
def test_message_is_never_empty(cls):
    assert cls("").message == f"{cls.kind.name.lower()} (no detail given)"
    assert cls("   ").info.message


def test_a_finer_code_keeps_the_kind():
    exc = errors.UnavailableError("loading", code="starting", retry_after=2.0)
    assert (exc.code, exc.info.kind, exc.status, exc.retry_after) == (
        "starting",
        ErrorKind.UNAVAILABLE,
        503,
        2.0,
    )


def test_errors_survive_pickling_with_their_fields():
    exc = QueueFullError("too much waiting", code="queue_full", retry_after=2.0, param="model")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is QueueFullError
    assert back.info == exc.info
    info = pickle.loads(pickle.dumps(exc.info))
    assert info.kind is ErrorKind.QUEUE_FULL and info == exc.info


def test_one_value_from_raise_to_handler():
    """The value a worker sends is the very one the raised exception carries: no conversion,
    and the exception's class follows from the kind (no class names anywhere)."""
    info = EngineDeadError("gone", stage="llm").info
    again = info.error()
    assert type(again) is EngineDeadError and again.info is info
    assert not hasattr(info, "error_class")
    bare = ErrorInfo(ErrorKind.METHOD_NOT_ALLOWED, "GET is not allowed")  # no class of its own
    assert type(bare.error()) is errors.OmniError and bare.error().status == 405


def test_classify_wraps_foreign_exceptions_as_recoverable_generate_errors():
    info = classify(KeyError("x"), "diffusion")
    assert info.kind is ErrorKind.GENERATE
    assert info.message == "stage 'diffusion': KeyError: 'x'"
    assert classify(ValueError(), None).message == "ValueError: ValueError"


def test_classify_keeps_taxonomy_errors_and_adds_the_stage():
    raised = InvalidRequestError("bad size", param="size")
    info = classify(raised, "diffusion")
    assert info.kind is ErrorKind.INVALID
    assert info.stage == "diffusion" and info.param == "size"
    assert info.message == "stage 'diffusion': bad size"
    staged = EngineGenerateError("x", stage="llm")
    assert classify(staged, "diffusion") is staged.info  # its own stage is kept


def test_request_output_from_error():
    out = OmniRequestOutput.from_error("req-1", RuntimeError("kaput"), "diffusion")
    assert not out.ok
    assert out.error.kind is ErrorKind.GENERATE
    assert out.error.status == 500
    assert out.error.message == "stage 'diffusion': RuntimeError: kaput"
    assert OmniRequestOutput("req-2").ok
    stage_out = StageOutput.from_error("req-3", EngineDeadError("dead"), "llm")
    assert stage_out.error.recoverable is False


def test_light_modules_do_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys; import vllm_omni_like, vllm_omni_like.wire, vllm_omni_like.inputs, "
        "vllm_omni_like.engine.events, vllm_omni_like.config, "
        "vllm_omni_like.outputs, vllm_omni_like.errors, vllm_omni_like.executor, "
        "vllm_omni_like.stages.null; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_device_errors_are_recognised_by_torchs_types_not_their_names():
    import torch

    from vllm_omni_like.errors import is_fatal_device_error, is_out_of_memory

    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert is_out_of_memory(oom) and not is_fatal_device_error(oom)
    assert is_out_of_memory(MemoryError()) and not is_fatal_device_error(MemoryError())
    assert hasattr(torch, "AcceleratorError")  # torch >= 2.8 (the tests run 2.13)
    lost = torch.AcceleratorError("an illegal memory access was encountered")  # no "CUDA error"
    assert is_fatal_device_error(lost) and not is_out_of_memory(lost)
    # a class of the same name is not torch's: its name decides nothing
    for name in ("OutOfMemoryError", "AcceleratorError"):
        namesake = type(name, (RuntimeError,), {})("a namesake")
        assert not is_out_of_memory(namesake) and not is_fatal_device_error(namesake)
    # what torch raises as a plain RuntimeError is known by its message
    assert is_fatal_device_error(RuntimeError("CUDA error: an illegal memory access"))
    assert is_fatal_device_error(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling"))
    assert not is_fatal_device_error(RuntimeError("shape mismatch"))


def test_recognising_a_device_error_never_imports_torch():
    import subprocess
    import sys

    code = (
        "import sys; from vllm_omni_like.errors import is_fatal_device_error, is_out_of_memory; "
        "e = RuntimeError('x'); print(is_out_of_memory(e), is_fatal_device_error(e), "
        "is_out_of_memory(MemoryError()), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "True", "False"]


def test_a_config_error_is_outside_the_http_taxonomy():
    assert issubclass(errors.ConfigError, ValueError)
    assert not issubclass(errors.ConfigError, errors.OmniError)
    assert not hasattr(errors.ConfigError("x"), "info")  # no kind, no status


def test_no_error_is_told_by_its_class_name():
    """docs/architecture.md ("Errors"): errors.py and the stages compare no class's name."""
    import re
    from pathlib import Path

    package = Path(errors.__file__).parent
    compared = re.compile(r"__name__\s*(==|!=|in\b)|(==|!=)\s*type\([^)]*\)\.__name__")
    for path in [package / "errors.py", *sorted((package / "stages").rglob("*.py"))]:
        assert not compared.search(path.read_text()), path

"""AsyncOmni, the one asyncio facade over the orchestrator; Omni, its thin synchronous wrapper."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import TypeVar

from vllm_omni_like.config import EngineConfig, PipelineConfig
from vllm_omni_like.engine.orchestrator import Orchestrator
from vllm_omni_like.engine.request_state import EngineStats
from vllm_omni_like.engine.stage_pool import ExecutorFactory
from vllm_omni_like.errors import (
    AbortedError,
    EngineDeadError,
    ErrorKind,
    InvalidRequestError,
    StorageError,
)
from vllm_omni_like.executor import factory_for, release
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.models.limits import ModelLimits, pipeline_limits
from vllm_omni_like.outputs import OmniRequestOutput, RequestEvent, RequestProgress

logger = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncOmni:
    """`generate` yields progress events, then the final OmniRequestOutput (result or error)."""

    def __init__(
        self, config: EngineConfig, executor_factory: ExecutorFactory | None = None
    ) -> None:
        self.config = config
        self.orchestrator = Orchestrator(config, executor_factory or factory_for(config))
        self._started = False
        self._limits: dict[str, ModelLimits] = {}

    def start(self) -> None:
        """Start every stage's workers; blocks until loaded; raises EngineDeadError on failure."""
        self.orchestrator.start()
        self._started = True

    async def start_async(self) -> None:
        await asyncio.to_thread(self.start)

    @property
    def errored(self) -> bool:
        return self.orchestrator.errored

    @property
    def started(self) -> bool:
        return self._started

    def check_health(self) -> None:
        if self.errored:
            raise self.orchestrator.dead_error

    def health(self) -> list[dict[str, object]]:
        return self.orchestrator.health()

    @property
    def stats(self) -> EngineStats:
        return self.orchestrator.stats

    @property
    def pipeline_names(self) -> list[str]:
        return list(self.orchestrator.pipelines)

    def pipeline_output(self, name: str) -> str:
        return self.orchestrator.pipelines[name].config.output

    def config_of(self, name: str) -> PipelineConfig:
        return self.orchestrator.pipelines[name].config

    def model_limits(self, name: str) -> ModelLimits:
        """What a request may ask of pipeline `name` (read from its model's config files once)."""
        if name not in self._limits:
            found = pipeline_limits(self.orchestrator.pipelines[name].config)
            if found is None:
                raise InvalidRequestError(f"model {name!r} makes no images or videos")
            self._limits[name] = found
        return self._limits[name]

    def open(self, request: OmniRequest, progress: bool = True) -> RequestStream:
        """Submit now (admission errors raise here, before any response starts; a request id
        already in the engine is a ConflictError).

        `progress=False`: only the final output is delivered (no per-step wake-ups of the loop).
        """
        stream = RequestStream(self, request.request_id, progress)
        self.orchestrator.submit(request, stream.emit)
        return stream

    async def generate(
        self, request: OmniRequest
    ) -> AsyncIterator[RequestProgress | OmniRequestOutput]:
        """Progress events, then the final output; a closed or cancelled consumer aborts."""
        stream = self.open(request)
        try:
            while (event := await stream.next()) is not None:
                yield event
        finally:
            stream.close()

    async def generate_final(self, request: OmniRequest) -> OmniRequestOutput:
        async for event in self.generate(request):
            if isinstance(event, OmniRequestOutput):
                return event
        raise EngineDeadError("the engine ended the request without an output")

    def abort(self, request_id: str, kind: ErrorKind = ErrorKind.ABORTED) -> None:
        """End a request early: the client left (ABORTED), its deadline passed (TIMEOUT) or the
        drain is over (SHUTTING_DOWN)."""
        self.orchestrator.abort(request_id, kind)

    async def store(self, request: OmniRequest, write: Awaitable[T], what: str) -> T:
        """Await the write of a finished request's output and report it: a request that
        `stores_output` has its final status recorded now, a success once its file is whole,
        an error (500 `storage_error`) if it could not be written, aborted if the caller was
        cancelled meanwhile."""
        if not request.stores_output:
            return await write
        rid = request.request_id
        try:
            result = await write
        except asyncio.CancelledError:  # the client left (or the server stops) mid-write
            self.orchestrator.stored(rid, AbortedError(f"the {what} was being stored").info)
            raise
        except Exception as exc:
            if isinstance(exc, OSError):  # "No space left on device", without the errno
                detail = exc.strerror or str(exc)
            else:
                detail = f"{type(exc).__name__}: {exc}"
            logger.warning("request %s: the %s could not be stored: %s", rid, what, exc)
            error = StorageError(f"the {what} was made but could not be stored: {detail}")
            self.orchestrator.stored(rid, error.info)
            raise error from None
        self.orchestrator.stored(rid)
        return result

    def cut_off(self, message: str) -> None:
        """End every request still running with a 503 `shutting_down` carrying `message`."""
        self.orchestrator.cut_off(message)

    def shutdown(self) -> None:
        self.orchestrator.shutdown()
        release(self.config)


class RequestStream:
    """The events of one submitted request, on the event loop that opened it."""

    def __init__(self, engine: AsyncOmni, request_id: str, progress: bool = True) -> None:
        self.engine = engine
        self.request_id = request_id
        self.progress = progress
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestProgress | OmniRequestOutput] = asyncio.Queue()
        self.finished = False

    def emit(self, event: RequestEvent) -> None:
        """Called on the orchestrator thread; a closed loop means nobody listens any more."""
        if not self.progress and isinstance(event, RequestProgress):
            return
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def next(
        self, timeout: float | None = None
    ) -> RequestProgress | OmniRequestOutput | None:
        """The next event; None after the final output; TimeoutError if none came in time."""
        if self.finished:
            return None
        # asyncio.timeout, not wait_for: before Python 3.12 wait_for swallows a cancellation that
        # comes as the awaited thing completes (the caller is never told it was cancelled)
        async with asyncio.timeout(timeout):
            event = await self.queue.get()  # Queue.get is cancel-safe: no event is lost
        if isinstance(event, OmniRequestOutput):
            self.finished = True
        return event

    def close(self) -> None:
        """Idempotent; aborts the request everywhere if it has not finished."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class Omni:
    """Offline, synchronous use: an event loop on a helper thread runs the same AsyncOmni path."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = AsyncOmni(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="omni-loop"
        )
        self._thread.start()
        try:
            self.engine.start()
        except BaseException:
            self.close()
            raise

    def generate(self, requests: Iterable[OmniRequest]) -> list[OmniRequestOutput]:
        """Run requests concurrently (the engine batches them); outputs in input order."""
        futures = [
            asyncio.run_coroutine_threadsafe(self.engine.generate_final(r), self._loop)
            for r in requests
        ]
        try:
            return [f.result() for f in futures]
        except BaseException:  # Ctrl+C: abort everything still running
            for f in futures:
                f.cancel()
            raise

    def submit(self, request: OmniRequest) -> concurrent.futures.Future[OmniRequestOutput]:
        """One request as a concurrent.futures.Future of its OmniRequestOutput."""
        return asyncio.run_coroutine_threadsafe(self.engine.generate_final(request), self._loop)

    def close(self) -> None:
        self.engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"

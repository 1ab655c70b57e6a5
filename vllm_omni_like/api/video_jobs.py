"""Video jobs in the background: a durable queue, progress from the denoising steps, expiry."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_omni_like.api.background import retrieve
from vllm_omni_like.api.video_store import VideoStore, write_durably
from vllm_omni_like.config import ServerSettings
from vllm_omni_like.engine import AsyncOmni
from vllm_omni_like.engine.async_omni import RequestStream
from vllm_omni_like.errors import (
    InvalidRequestError,
    OmniError,
    QueueFullError,
    RequestTimeoutError,
    ShuttingDownError,
    UnavailableError,
)
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.media import encode_image
from vllm_omni_like.outputs import OmniRequestOutput, RequestProgress
from vllm_omni_like.protocol.requests import video_request
from vllm_omni_like.protocol.schemas import VideoRequest
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.video_codec import encode_video

logger = logging.getLogger(__name__)

PROGRESS_WRITE_S = 0.2  # at most this often a progress write to SQLite
POLL_AFTER_MS = 100
SWEEP_S = 30.0
DISPATCH_POLL_S = 0.5  # the dispatcher looks at the queue this often without a wake-up
HOLD_S = 0.25  # after the engine had no room (queue full, stage restarting): wait this long
CUTOFF_SETTLE_S = 2.0  # after the drain's cut-off: time for cut jobs to record themselves
STOP_BOUND_S = 5.0  # at shutdown, how long cancelled tasks get to end
INPUT_EXT = "input.png"  # a job's input_reference, kept until the job ends
INPUT_DIGEST = "input_reference_sha256"  # its pixels' digest, in the job's parameters


def _keep(path: str, image: Any) -> str:
    """Write an input_reference durably as a PNG (lossless); its pixels' SHA-256."""
    write_durably(path, encode_image(image))
    digest = hashlib.sha256(f"{image.shape}".encode())
    digest.update(np.ascontiguousarray(image).tobytes())
    return digest.hexdigest()


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def video_object(row: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's video object; `size`, `seconds` and the extensions `num_frames` and `fps` say
    what is (or will be) made, never merely what was asked."""
    params = json.loads(row["params"])
    error = None
    if row["status"] == "failed":
        error = {
            "code": row["error_code"] or "failed",
            "message": row["error_message"] or "the video failed",
        }
    return {
        "id": row["id"],
        "object": "video",
        "model": row["model"],
        "status": row["status"],
        "progress": row["progress"],
        "created_at": row["created_at"],
        "completed_at": row["completed_at"],
        "expires_at": row["expires_at"],
        "seconds": row["seconds"],
        "size": row["size"],
        "num_frames": params.get("num_frames"),
        "fps": params.get("fps"),
        "prompt": row["prompt"],
        "remixed_from_video_id": None,
        "error": error,
    }


class VideoService:
    def __init__(
        self,
        engine: AsyncOmni,
        settings: ServerSettings,
        on_encoded: Callable[[float], None] | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.on_encoded = on_encoded  # seconds to encode and store each finished video
        self.store = VideoStore(settings.storage_dir)
        self.faults = FaultInjector(engine.config.faults, "videos")  # point=store rules
        self.running: dict[str, tuple[asyncio.Task, RequestStream | None]] = {}
        self.draining = False
        self._wake = asyncio.Event()
        self._held_until = 0.0  # the engine refused room: no dispatch before this (loop time)
        self._refused_since: dict[str, float] = {}  # job -> when the engine first had no room
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        failed = await asyncio.to_thread(self.store.fail_interrupted)
        if failed:
            logger.warning("%d video jobs were running at the last shutdown: marked failed", failed)
        await asyncio.to_thread(self._drop_stale_inputs)
        self._tasks = [
            asyncio.create_task(self._dispatch_forever()),
            asyncio.create_task(self._sweep_forever()),
        ]

    def begin_drain(self) -> None:
        """Shutdown began: queued jobs stay queued for the next start; running ones go on."""
        self.draining = True

    async def stop(self, deadline: float | None = None) -> None:
        """Running jobs may finish until `deadline` (loop time; at it the server's cut-off ends
        them and they are queued again); any still running after that is queued again too."""
        self.draining = True
        for task in self._tasks:
            task.cancel()
        jobs = [task for task, _ in self.running.values()]
        if jobs and deadline is not None:
            left = deadline - asyncio.get_running_loop().time() + CUTOFF_SETTLE_S
            await asyncio.wait(jobs, timeout=max(0.0, left))
        unfinished = list(self.running)
        for task, stream in list(self.running.values()):
            task.cancel()
            if stream is not None:
                stream.close()
        tasks = [*self._tasks, *jobs]
        if tasks:  # bounded: a shutdown never waits on a task that ignores its cancel
            _, stuck = await asyncio.wait(tasks, timeout=STOP_BOUND_S)
            if stuck:
                logger.error("%d video tasks did not end when cancelled: left behind", len(stuck))
            for task in tasks:
                if task.done():
                    retrieve(task)  # a job's failure is already in its row
        for video_id in unfinished:
            await asyncio.to_thread(self.store.requeue, video_id)
        if unfinished:
            logger.warning("%d video jobs cut off by the shutdown: queued again", len(unfinished))
        await asyncio.to_thread(self.store.close)

    # ---- API -----------------------------------------------------------------------------------
    async def create(
        self, body: VideoRequest, idempotency_key: str | None, image: Any = None
    ) -> dict[str, Any]:
        """Queue a job. `image` (input_reference, HxWx3 uint8) is kept beside the job as a PNG
        until it ends, so a job queued across a restart still has it; its digest is in the
        job's parameters (an idempotent retry must send the same image)."""
        images = None if image is None else [image]
        req = video_request(self.engine, body, self.settings.limits, "probe", images)  # validates
        p = req.params
        # the job runs exactly what the object reports: the model's size, frames and fps
        frames, fps, size = p.num_frames, p.fps, f"{p.width}x{p.height}"
        if frames is None or fps is None:  # (admission sets both)
            raise ValueError("a video request without its frames or fps")
        resolved: dict[str, Any] = {"size": size, "num_frames": frames, "fps": fps}
        video_id = f"video_{secrets.token_hex(16)}"
        reference = self.store.media_path(video_id, INPUT_EXT)
        if image is not None:
            resolved[INPUT_DIGEST] = await asyncio.to_thread(_keep, reference, image)
        try:
            row = await asyncio.to_thread(
                self.store.create,
                video_id,
                req.pipeline,
                f"{frames / fps:g}",
                size,
                body.prompt,
                {**body.model_dump(exclude_none=True), **resolved},
                idempotency_key,
            )
        finally:  # (refused, or a retry answered with the first job: this id was not stored)
            if image is not None and await asyncio.to_thread(self.store.get, video_id) is None:
                await asyncio.to_thread(_unlink, reference)
        self._wake.set()
        return row

    def _drop_stale_inputs(self) -> None:
        """At start: an input_reference whose job is no longer queued (it failed as the server
        died, or the server died between keeping it and queueing the job) goes."""
        suffix = f".{INPUT_EXT}"
        for name in os.listdir(self.store.media_dir):
            if name.endswith(suffix):
                row = self.store.get(name[: -len(suffix)])
                if row is None or row["status"] != "queued":
                    _unlink(os.path.join(self.store.media_dir, name))

    def _input(self, video_id: str) -> list[Any]:
        """The job's input_reference, as kept at create."""
        from PIL import Image

        try:
            with Image.open(self.store.media_path(video_id, INPUT_EXT)) as image:
                return [np.asarray(image.convert("RGB"))]
        except OSError as exc:
            raise InvalidRequestError(
                f"the job's input_reference is gone from the storage dir ({exc})",
                param="input_reference",
                code="input_reference_missing",
            ) from None

    async def get(self, video_id: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self.store.get, video_id)

    async def delete(self, video_id: str) -> bool:
        self._refused_since.pop(video_id, None)
        task, stream = self.running.pop(video_id, (None, None))
        if stream is not None:
            stream.close()  # the engine aborts it
        if task is not None:
            task.cancel()
        row = await asyncio.to_thread(self.store.get, video_id)
        if row is None:
            return False
        await asyncio.to_thread(self._remove, row)
        return True

    def _remove(self, row: dict[str, Any]) -> None:
        self.store.delete(row["id"])
        for path in (row["file"], row["thumbnail"], self.store.media_path(row["id"], INPUT_EXT)):
            if path:
                _unlink(path)

    # ---- the queue ------------------------------------------------------------------------------
    async def _dispatch_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            held = self._held_until - loop.time()
            # a wake-up, or a slow poll; never a spin. asyncio.timeout, not wait_for: before
            # Python 3.12 wait_for swallows a cancel that comes with a wake-up, and stop() waited
            # on this loop for ever (a job's end wakes it just as stop() cancels it)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(held if held > 0 else DISPATCH_POLL_S):
                    await self._wake.wait()
            self._wake.clear()
            if self.draining or not self.engine.started or loop.time() < self._held_until:
                continue
            room = self.settings.video_concurrency - len(self.running)
            if room <= 0:
                continue
            for row in await asyncio.to_thread(self.store.queued, room):
                if row["id"] in self.running:
                    continue
                task = asyncio.create_task(self._run(row))
                self.running[row["id"]] = (task, None)

    async def _run(self, row: dict[str, Any]) -> None:
        video_id, stream, wake = row["id"], None, True
        try:
            fields = json.loads(row["params"])
            from_image = fields.pop(INPUT_DIGEST, None) is not None  # (the job's, not the body's)
            images = await asyncio.to_thread(self._input, video_id) if from_image else None
            omni = video_request(
                self.engine,
                VideoRequest.model_validate(fields),
                self.settings.limits,
                video_id,
                images,
                timeout=self.settings.video_timeout,
            )
            stream = self._open(video_id, omni)
            if stream is None:  # no room in the engine now: stays queued, tried again later
                wake = False
                return
            if video_id not in self.running:  # deleted meanwhile
                return
            self.running[video_id] = (self.running[video_id][0], stream)
            await asyncio.to_thread(self.store.update, video_id, status="in_progress")
            output = await self._follow(video_id, stream)
            if output.error is not None:
                raise output.error.error()
            write = asyncio.to_thread(self._write_files, row, output, omni)
            await self.engine.store(omni, write, "video")
        except asyncio.CancelledError:
            raise
        except OmniError as exc:
            if isinstance(exc, ShuttingDownError):  # cut off by the drain: the next start runs it
                await asyncio.to_thread(self.store.requeue, video_id)
            else:
                await self._fail(video_id, exc.code, exc.message)
        except Exception as exc:  # never left in_progress, whatever went wrong
            logger.exception("video job %s failed", video_id)
            await self._fail(video_id, "internal_error", f"{type(exc).__name__}: {exc}")
        finally:
            if stream is not None:
                stream.close()  # a no-op once finished; else the engine aborts it
            self.running.pop(video_id, None)
            if wake:
                self._wake.set()

    def _open(self, video_id: str, omni: OmniRequest) -> RequestStream | None:
        """Submit the job; None while the engine has no room for it (its queue is full, or its
        stage restarts), for at most --video-timeout; then the refusal is the job's failure."""
        loop = asyncio.get_running_loop()
        try:
            stream = self.engine.open(omni)
        except (QueueFullError, UnavailableError) as exc:
            first = self._refused_since.setdefault(video_id, loop.time())
            if loop.time() - first > self.settings.video_timeout:
                self._refused_since.pop(video_id, None)
                raise RequestTimeoutError(
                    f"the job found no room in the engine for {self.settings.video_timeout:g}s "
                    f"(--video-timeout): {exc.message}"
                ) from None
            self._held_until = loop.time() + HOLD_S
            return None
        self._refused_since.pop(video_id, None)
        return stream

    async def _fail(self, video_id: str, code: str, message: str) -> None:
        await asyncio.to_thread(
            self.store.update,
            video_id,
            status="failed",
            error_code=code,
            error_message=message,
            completed_at=int(time.time()),
        )
        await asyncio.to_thread(_unlink, self.store.media_path(video_id, INPUT_EXT))

    async def _follow(self, video_id: str, stream: RequestStream) -> OmniRequestOutput:
        last_write = 0.0
        while True:
            event = await stream.next()
            if isinstance(event, OmniRequestOutput):
                return event
            if isinstance(event, RequestProgress) and event.total:
                now = time.monotonic()
                if now - last_write >= PROGRESS_WRITE_S:
                    last_write = now
                    pct = min(99, int(100 * event.step / event.total))
                    await asyncio.to_thread(self.store.update, video_id, progress=pct)

    def _write_files(
        self, row: dict[str, Any], output: OmniRequestOutput, omni: OmniRequest
    ) -> None:
        video_id, video = row["id"], output.result.video
        if video is None:
            raise ValueError(f"video {row['id']}: the stage made no video")
        path = self.store.media_path(video_id, "mp4")
        thumb = self.store.media_path(video_id, "png")
        try:
            self.faults.fire("store", [omni])
            started = time.monotonic()
            # the stage's MP4 when it encoded while decoding (stages/diffusion/video_stream.py)
            mp4 = video.mp4 if video.mp4 is not None else encode_video(video.frames, video.fps)
            write_durably(path, mp4)
            png = video.thumbnail
            if png is None:  # (then the frames came: files_only keeps them only with both)
                png = encode_image(video.frames[len(video.frames) // 2])
            write_durably(thumb, png)
            if self.on_encoded is not None:
                self.on_encoded(time.monotonic() - started)
        except BaseException:
            for done in (path, thumb):  # a failed job leaves no file behind
                with contextlib.suppress(OSError):
                    os.unlink(done)
            raise
        now = int(time.time())
        frames, h, w = video.shape
        made = {"num_frames": frames, "fps": video.fps}  # what was made, not what was asked
        # the row says completed only once both files are whole on disk
        self.store.update(
            video_id,
            status="completed",
            progress=100,
            completed_at=now,
            expires_at=now + int(self.settings.file_ttl),
            file=path,
            thumbnail=thumb,
            size=f"{w}x{h}",
            seconds=f"{frames / video.fps:g}",
            params=json.dumps({**json.loads(row["params"]), **made}),
        )
        _unlink(self.store.media_path(video_id, INPUT_EXT))  # (its video is made)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            for row in await asyncio.to_thread(self.store.expired, int(time.time())):
                await asyncio.to_thread(self._remove, row)

"""Video jobs in the background: a durable queue, progress from the denoising steps, expiry."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from typing import Any

from vllm_omni_like.api.protocol import VideoRequest
from vllm_omni_like.api.requests import video_request
from vllm_omni_like.api.video_store import VideoStore, write_durably
from vllm_omni_like.config import ServerSettings
from vllm_omni_like.engine import AsyncOmni
from vllm_omni_like.engine.async_omni import RequestStream
from vllm_omni_like.errors import OmniError, QueueFullError
from vllm_omni_like.media import encode_image, encode_video
from vllm_omni_like.outputs import OmniRequestOutput, RequestProgress

logger = logging.getLogger(__name__)

PROGRESS_WRITE_S = 0.2  # at most this often a progress write to SQLite
POLL_AFTER_MS = 100
SWEEP_S = 30.0


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
    def __init__(self, engine: AsyncOmni, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.store = VideoStore(settings.storage_dir)
        self.running: dict[str, tuple[asyncio.Task, RequestStream | None]] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        failed = await asyncio.to_thread(self.store.fail_interrupted)
        if failed:
            logger.warning("%d video jobs were running at the last shutdown: marked failed", failed)
        self._tasks = [
            asyncio.create_task(self._dispatch_forever()),
            asyncio.create_task(self._sweep_forever()),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        jobs = [task for task, _ in self.running.values()]
        for task in jobs:
            task.cancel()
        await asyncio.gather(*self._tasks, *jobs, return_exceptions=True)
        await asyncio.to_thread(self.store.close)

    # ---- API -----------------------------------------------------------------------------------
    async def create(self, body: VideoRequest, idempotency_key: str | None) -> dict[str, Any]:
        req = video_request(self.engine, body, self.settings.limits, "probe")  # validates
        p = req.params
        # the job runs exactly what the object reports: the model's size, frames and fps
        resolved = {"size": f"{p.width}x{p.height}", "num_frames": p.num_frames, "fps": p.fps}
        row = await asyncio.to_thread(
            self.store.create,
            f"video_{secrets.token_hex(16)}",
            req.pipeline,
            f"{p.num_frames / p.fps:g}",
            resolved["size"],
            body.prompt,
            {**body.model_dump(exclude_none=True), **resolved},
            idempotency_key,
        )
        self._wake.set()
        return row

    async def get(self, video_id: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self.store.get, video_id)

    async def delete(self, video_id: str) -> bool:
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
        for path in (row["file"], row["thumbnail"]):
            if path:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    # ---- the queue ------------------------------------------------------------------------------
    async def _dispatch_forever(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.5)
            self._wake.clear()
            if not self.engine.started:
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
        video_id = row["id"]
        try:
            body = VideoRequest.model_validate_json(row["params"])
            omni = video_request(
                self.engine,
                body,
                self.settings.limits,
                video_id,
                timeout=self.settings.video_timeout,
            )
            try:
                stream = self.engine.open(omni)
            except QueueFullError:
                return  # stays queued; the next dispatch tries again
            if video_id not in self.running:  # deleted meanwhile
                stream.close()
                return
            self.running[video_id] = (self.running[video_id][0], stream)
            await asyncio.to_thread(self.store.update, video_id, status="in_progress")
            output = await self._follow(video_id, stream)
            await self._finish(row, output)
        except asyncio.CancelledError:
            raise
        except OmniError as exc:
            await asyncio.to_thread(
                self.store.update,
                video_id,
                status="failed",
                error_code=exc.code,
                error_message=exc.message,
                completed_at=int(time.time()),
            )
        finally:
            self.running.pop(video_id, None)
            self._wake.set()

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

    async def _finish(self, row: dict[str, Any], output: OmniRequestOutput) -> None:
        if output.error is not None:
            raise output.error.to_exception()  # recorded as the job's failure by _run
        await asyncio.to_thread(self._write_files, row, output)

    def _write_files(self, row: dict[str, Any], output: OmniRequestOutput) -> None:
        video_id, video = row["id"], output.output.video
        path = self.store.media_path(video_id, "mp4")
        thumb = self.store.media_path(video_id, "png")
        write_durably(path, encode_video(video.frames, video.fps))
        write_durably(thumb, encode_image(video.frames[len(video.frames) // 2]))
        now = int(time.time())
        frames, h, w = video.frames.shape[:3]
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

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            for row in await asyncio.to_thread(self.store.expired, int(time.time())):
                await asyncio.to_thread(self._remove, row)

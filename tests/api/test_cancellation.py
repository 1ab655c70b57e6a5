"""A cancellation that arrives just as the awaited thing completes is never lost.

Before Python 3.12, `asyncio.wait_for` returns the result in that case and the task never learns
it was cancelled. The videos dispatcher waited for its wake-up that way: a job's end woke it in
the same loop turn as the shutdown cancelled it, it looped on, and the server never exited (a
CI run: `serve` still up 12 s after SIGTERM, stuck in `VideoService.stop`). Each test builds
that exact turn: the wake-up completes, then the cancel comes before the task resumes."""

from __future__ import annotations

import asyncio

import pytest

from vllm_omni_like.api.chat import _merged
from vllm_omni_like.api.video_jobs import VideoService
from vllm_omni_like.config import EngineConfig, ServerSettings
from vllm_omni_like.engine import AsyncOmni
from vllm_omni_like.engine.async_omni import RequestStream
from vllm_omni_like.outputs import RequestProgress
from vllm_omni_like.pipelines.catalog import resolve

WAIT_S = 3.0  # the test's own bound on a stop() call: a hang fails it, never blocks


def _engine() -> AsyncOmni:  # never started: nothing here reaches a worker
    return AsyncOmni(EngineConfig(pipelines=tuple(resolve("null-video"))))


def test_video_service_stop_ends_when_a_wake_up_meets_the_cancel(tmp_path):
    settings = ServerSettings(host="127.0.0.1", port=0, storage_dir=str(tmp_path))

    async def scenario() -> float:
        videos = VideoService(_engine(), settings)
        await videos.start()
        dispatcher = videos._tasks[0]
        await asyncio.sleep(0.05)  # the dispatcher waits for a wake-up (the engine is not up)
        videos._wake.set()  # a job ended ...
        await asyncio.sleep(0)  # ... and its wake-up has completed when stop() cancels
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.wait_for(videos.stop(), WAIT_S)
        assert dispatcher.cancelled()
        return loop.time() - start

    took = asyncio.run(scenario())
    assert took < 1.0, took


def test_a_stream_cancelled_as_its_event_arrives_raises_and_keeps_the_event():
    async def scenario() -> None:
        stream = RequestStream(_engine(), "req-x")
        reader = asyncio.create_task(stream.next(timeout=10))
        await asyncio.sleep(0)  # the reader waits for an event
        event = RequestProgress("req-x", "diffusion", 1, 2)
        stream.queue.put_nowait(event)  # the event arrives ...
        reader.cancel()  # ... and the cancel too, before the reader resumes
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert stream.queue.get_nowait() is event  # not lost: the next reader gets it

    asyncio.run(scenario())


def test_the_chat_merge_cancelled_as_an_event_arrives_raises():
    async def scenario() -> None:
        stream = RequestStream(_engine(), "req-y")
        merged = _merged([stream], keepalive=10)
        reader = asyncio.create_task(merged.__anext__())
        for _ in range(3):  # the reader and the stream's pump both wait
            await asyncio.sleep(0)
        stream.queue.put_nowait(RequestProgress("req-y", "llm", 1, 2))
        await asyncio.sleep(0)  # the pump hands it on: the reader's get completes ...
        reader.cancel()  # ... as the cancel comes
        with pytest.raises(asyncio.CancelledError):
            await reader
        await merged.aclose()  # its finally cancels the pump

    asyncio.run(scenario())


def test_video_service_stop_is_bounded_by_a_task_that_ignores_its_cancel(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr("vllm_omni_like.api.video_jobs.STOP_BOUND_S", 0.5)
    settings = ServerSettings(host="127.0.0.1", port=0, storage_dir=str(tmp_path))

    async def scenario() -> float:
        videos = VideoService(_engine(), settings)
        await videos.start()
        released = asyncio.Event()

        async def stubborn() -> None:
            while not released.is_set():
                try:
                    await released.wait()
                except asyncio.CancelledError:
                    continue  # ignored: until the test releases it

        task = asyncio.create_task(stubborn())
        videos._tasks.append(task)
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.wait_for(videos.stop(), WAIT_S)
        took = loop.time() - start
        assert not task.done()
        released.set()
        await task
        return took

    took = asyncio.run(scenario())
    assert 0.5 <= took < 1.5, took
    assert "1 video tasks did not end when cancelled: left behind" in caplog.text

"""The FastAPI app: factory, lifespan (engine start, video jobs), routers, one error handler."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable

from fastapi import FastAPI

from vllm_omni_like import __version__
from vllm_omni_like.api import chat, errors, health, images, playground, videos
from vllm_omni_like.api.file_store import FileStore
from vllm_omni_like.api.metrics import Metrics
from vllm_omni_like.api.middleware import GatewayMiddleware
from vllm_omni_like.api.serving import Server
from vllm_omni_like.api.video_jobs import VideoService
from vllm_omni_like.config import ServerSettings
from vllm_omni_like.engine import AsyncOmni
from vllm_omni_like.stages.faults import FaultInjector

logger = logging.getLogger(__name__)
SWEEP_S = 30.0


def create_app(
    engine: AsyncOmni, settings: ServerSettings, on_fatal: Callable[[str], None] | None = None
) -> FastAPI:
    """The server listens at once; /health says 503 'starting' until every stage has loaded.

    If loading fails, `on_fatal` is called with the reason (the serve command exits non-zero).
    """
    os.makedirs(settings.storage_dir, exist_ok=True)
    files = FileStore(
        os.path.join(settings.storage_dir, "images"),
        settings.url_ttl,
        FaultInjector(engine.config.faults, "files"),
    )
    server = Server(engine, settings, files)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.loop = asyncio.get_running_loop()  # leak checks count its tasks
        server.videos = VideoService(engine, settings, app.state.metrics.video_encode.observe)
        await server.videos.start()
        starter = asyncio.create_task(_start_engine(server, on_fatal))
        sweeper = asyncio.create_task(_sweep_files(server))
        try:
            yield
        finally:
            sweeper.cancel()
            starter.cancel()
            if not engine.started and server.start_error is None:
                logger.info("shut down while the stages load: the load is stopped")
            await server.videos.stop(server.drain_deadline)
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="vllm_omni_like", version=__version__, lifespan=lifespan)
    app.state.server = server
    app.state.engine = engine
    app.state.metrics = Metrics(engine)
    errors.install(app)
    for module in (images, videos, chat, health, playground):
        app.include_router(module.router)
    app.add_middleware(
        GatewayMiddleware,
        api_keys=settings.api_keys,
        max_body_bytes=settings.limits.max_body_bytes,
        on_reject=engine.stats.reject,
    )
    return app


async def _start_engine(server: Server, on_fatal: Callable[[str], None] | None) -> None:
    if server.engine.started:
        return
    try:
        await server.engine.start_async()
        logger.info("engine ready: %s", ", ".join(server.engine.pipeline_names))
    except Exception as exc:
        server.start_error = str(exc)
        if server.draining:  # SIGTERM during the load stopped it: not a failure
            logger.info("loading stopped: the server is shutting down")
            return
        logger.error("engine failed to start: %s", exc)
        if on_fatal is not None:
            on_fatal(str(exc))


async def _sweep_files(server: Server) -> None:
    while True:
        await asyncio.sleep(SWEEP_S)
        await asyncio.to_thread(server.files.sweep)

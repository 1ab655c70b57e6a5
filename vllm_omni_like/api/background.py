"""Work left to run on the event loop with nobody awaiting it."""

from __future__ import annotations

import asyncio


def retrieve(future: asyncio.Future) -> None:
    """Read an ended future's outcome: one nobody reads makes asyncio log "exception was never
    retrieved" when it is collected."""
    if not future.cancelled():
        future.exception()

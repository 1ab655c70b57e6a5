"""Durable video jobs: one SQLite file (WAL) and the media files, under --storage-dir.

Every method is blocking: callers run them in a thread, never on the event loop.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import threading
import time
from typing import Any

from vllm_omni_like.errors import ConflictError, EngineDeadError

SCHEMA = """
CREATE TABLE IF NOT EXISTS videos (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    model TEXT NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at INTEGER,
    seconds TEXT NOT NULL,
    size TEXT NOT NULL,
    prompt TEXT NOT NULL,
    params TEXT NOT NULL,
    error_code TEXT,
    error_message TEXT,
    idempotency_key TEXT UNIQUE,
    file TEXT,
    thumbnail TEXT
);
CREATE INDEX IF NOT EXISTS videos_status ON videos (status, seq);
"""
COLUMNS = (
    "seq",
    "id",
    "model",
    "status",
    "progress",
    "created_at",
    "completed_at",
    "expires_at",
    "seconds",
    "size",
    "prompt",
    "params",
    "error_code",
    "error_message",
    "idempotency_key",
    "file",
    "thumbnail",
)


class VideoStore:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.media_dir = os.path.join(directory, "videos")
        os.makedirs(self.media_dir, exist_ok=True)
        self._lock_file = open(os.path.join(directory, ".lock"), "w")  # noqa: SIM115
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise EngineDeadError(
                f"another server already uses the storage dir {directory!r}", code="storage_locked"
            ) from None
        self.db = sqlite3.connect(
            os.path.join(directory, "videos.db"), check_same_thread=False, isolation_level=None
        )
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self.db.close()
        self._lock_file.close()

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        with self._lock:
            cur = self.db.execute(sql, args)
            return [dict(zip(COLUMNS, row, strict=True)) for row in cur.fetchall()]

    def _exec(self, sql: str, args: tuple = ()) -> int:
        with self._lock:
            return self.db.execute(sql, args).rowcount

    def create(
        self,
        video_id: str,
        model: str,
        seconds: str,
        size: str,
        prompt: str,
        params: dict[str, Any],
        idempotency_key: str | None,
    ) -> dict[str, Any]:
        """Insert a queued job; with a known idempotency key, return that job instead."""
        cols = ", ".join(COLUMNS)
        with self._lock:
            if idempotency_key:
                row = self.db.execute(
                    f"SELECT {cols} FROM videos WHERE idempotency_key = ?", (idempotency_key,)
                ).fetchone()
                if row:
                    found = dict(zip(COLUMNS, row, strict=True))
                    if json.loads(found["params"]) != json.loads(json.dumps(params)):
                        raise ConflictError(
                            f"Idempotency-Key {idempotency_key!r} was used for another request "
                            f"({found['id']}); use a new key for a new video",
                            param="Idempotency-Key",
                            code="idempotency_key_reused",
                        )
                    return found
            self.db.execute(
                "INSERT INTO videos (id, model, status, created_at, seconds, size, prompt, params,"
                " idempotency_key) VALUES (?, ?, 'queued', ?, ?, ?, ?, ?, ?)",
                (
                    video_id,
                    model,
                    int(time.time()),
                    seconds,
                    size,
                    prompt,
                    json.dumps(params),
                    idempotency_key,
                ),
            )
        row = self.get(video_id)
        if row is None:  # (only a store deleted under us: its file removed by hand)
            raise RuntimeError(f"video {video_id} vanished from the store as it was made")
        return row

    def get(self, video_id: str) -> dict[str, Any] | None:
        rows = self._rows(f"SELECT {', '.join(COLUMNS)} FROM videos WHERE id = ?", (video_id,))
        return rows[0] if rows else None

    def page(self, after: str | None, limit: int, order: str) -> tuple[list[dict[str, Any]], bool]:
        cols = ", ".join(COLUMNS)
        op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        where, args = "", tuple[Any, ...]()
        if after:
            anchor = self.get(after)
            if anchor is not None:
                where, args = f"WHERE seq {op} ?", (anchor["seq"],)
        rows = self._rows(
            f"SELECT {cols} FROM videos {where} ORDER BY seq {direction} LIMIT ?",
            (*args, limit + 1),
        )
        return rows[:limit], len(rows) > limit

    def update(self, video_id: str, **fields: Any) -> None:
        sets = ", ".join(f"{k} = ?" for k in fields)
        self._exec(f"UPDATE videos SET {sets} WHERE id = ?", (*fields.values(), video_id))

    def delete(self, video_id: str) -> bool:
        return self._exec("DELETE FROM videos WHERE id = ?", (video_id,)) > 0

    def queued(self, limit: int) -> list[dict[str, Any]]:
        return self._rows(
            f"SELECT {', '.join(COLUMNS)} FROM videos WHERE status = 'queued' "
            "ORDER BY seq ASC LIMIT ?",
            (limit,),
        )

    def requeue(self, video_id: str) -> None:
        """A job cut off by a graceful shutdown runs again, from the start, at the next one."""
        self._exec(
            "UPDATE videos SET status = 'queued', progress = 0 WHERE id = ? "
            "AND status IN ('queued', 'in_progress')",
            (video_id,),
        )

    def fail_interrupted(self) -> int:
        """Jobs that were running when the server died are failed, never left in_progress."""
        return self._exec(
            "UPDATE videos SET status = 'failed', error_code = 'server_restarted', "
            "error_message = 'the server restarted while this video was being generated', "
            "completed_at = ? WHERE status = 'in_progress'",
            (int(time.time()),),
        )

    def expired(self, now: int) -> list[dict[str, Any]]:
        return self._rows(
            f"SELECT {', '.join(COLUMNS)} FROM videos WHERE expires_at IS NOT NULL"
            " AND expires_at <= ?",
            (now,),
        )

    def media_path(self, video_id: str, ext: str) -> str:
        return os.path.join(self.media_dir, f"{video_id}.{ext}")


def write_durably(path: str, data: bytes) -> None:
    """Temporary name, fsync, rename: a reader sees the whole file or none."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk leaves no partial file
            os.unlink(tmp)
        raise

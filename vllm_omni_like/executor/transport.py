"""Framing over a multiprocessing Connection with pickle protocol 5 out-of-band buffers.

Arrays (numpy images, video frames) are not copied into the pickle stream: each contiguous
buffer travels as its own frame and is received straight into a writable bytearray. A worker
talks to its executor through a `Channel`; `PipeChannel` is this framing over a pipe.
"""

from __future__ import annotations

import pickle
import threading
from multiprocessing.connection import Connection
from typing import Any, Protocol


def send(conn: Connection, obj: Any, lock: threading.Lock) -> None:
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    header = pickle.dumps((len(body), [r.nbytes for r in raws]), protocol=5)
    with lock:
        conn.send_bytes(header)
        conn.send_bytes(body)
        for raw in raws:
            conn.send_bytes(raw)


def recv(conn: Connection) -> Any:
    """Blocks; raises EOFError (or OSError) once the other side is gone."""
    _, sizes = pickle.loads(conn.recv_bytes())
    body = conn.recv_bytes()
    buffers = []
    for size in sizes:
        buf = bytearray(size)
        if size:
            conn.recv_bytes_into(buf)
        else:
            conn.recv_bytes()
        buffers.append(buf)
    return pickle.loads(body, buffers=buffers)


class Channel(Protocol):
    """A worker's two-way line to its executor."""

    def send(self, msg: object) -> None:
        """Thread-safe."""

    def recv(self) -> object:
        """Blocks; raises EOFError (or OSError) once the executor is gone."""


class PipeChannel:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, msg: object) -> None:
        send(self.conn, msg, self.lock)

    def recv(self) -> object:
        return recv(self.conn)

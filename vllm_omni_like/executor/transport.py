"""Framing over a multiprocessing Connection with pickle protocol 5 out-of-band buffers.

Arrays (numpy images, video frames) are not copied into the pickle stream: each contiguous
buffer travels as its own frame and is received straight into a writable bytearray.
"""

from __future__ import annotations

import pickle
import threading
from multiprocessing.connection import Connection
from typing import Any


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

import pickle
import threading
from multiprocessing import Pipe

import numpy as np

from vllm_omni_like.executor import transport
from vllm_omni_like.outputs import ImagePayload, StageOutput
from vllm_omni_like.wire import RequestResult


def test_arrays_travel_out_of_band_and_arrive_writable():
    a, b = Pipe()
    pixels = np.arange(512 * 512 * 3, dtype=np.uint8).reshape(512, 512, 3)
    msg = RequestResult(7, StageOutput("r", "diffusion", images=[ImagePayload(pixels, seed=1)]))
    buffers = []
    body = pickle.dumps(msg, protocol=5, buffer_callback=buffers.append)
    assert len(body) < 4096 and len(buffers) == 1  # the pixels are not in the pickle stream
    sender = threading.Thread(target=transport.send, args=(a, msg, threading.Lock()))
    sender.start()
    got = transport.recv(b)
    sender.join()
    out = got.output.images[0].pixels
    assert np.array_equal(out, pixels)
    assert out.flags.writeable
    a.close()
    b.close()


def test_recv_raises_eof_when_the_peer_is_gone():
    a, b = Pipe()
    a.close()
    try:
        transport.recv(b)
    except EOFError:
        pass
    else:
        raise AssertionError("expected EOFError")

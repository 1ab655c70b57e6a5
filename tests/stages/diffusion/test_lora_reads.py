"""Adapter files read off the main thread (stages/diffusion/lora_reads.py), with a fake reader:
a read runs once per file version, its verdict (weights or why not) is kept, a changed file is
a new key, a reader's unexpected error is the file's LoraError, and a wait is bounded."""

from __future__ import annotations

import os
import threading
import time

import pytest

from vllm_omni_like.loras import LoraSpec
from vllm_omni_like.stages.diffusion.lora_files import AdapterWeights, LoraError
from vllm_omni_like.stages.diffusion.lora_reads import LoraReads, key_of


def _weights(name: str) -> AdapterWeights:
    return AdapterWeights(name, {}, 1, None, None)


def test_a_file_is_read_once_a_version_and_again_once_it_changed(tmp_path):
    path = tmp_path / "a.safetensors"
    path.write_bytes(b"one")
    spec, reads = LoraSpec("a", str(path)), []
    reader = LoraReads(lambda s: reads.append(s) or _weights(s.name), kept=4)
    first = key_of(spec)
    reader.start(first)
    assert reader.result(first).name == "a" and reader.result(first).name == "a"
    assert len(reads) == 1 and reader.ready(first)
    path.write_bytes(b"longer")  # (another size: another version)
    second = key_of(spec)
    assert second != first and not reader.ready(second)
    reader.result(second)
    assert len(reads) == 2


def test_a_readers_unexpected_error_is_the_files_lora_error_kept_as_its_verdict(tmp_path):
    path = tmp_path / "b.safetensors"
    path.write_bytes(b"x")
    calls = []

    def broken(spec: LoraSpec) -> AdapterWeights:
        calls.append(spec)
        raise KeyError("alpha")

    reader, key = LoraReads(broken, kept=4), key_of(LoraSpec("b", str(path)))
    for _ in range(2):
        with pytest.raises(LoraError) as info:
            reader.result(key)
        assert str(info.value) == "LoRA 'b': unreadable (KeyError: 'alpha')"
    assert len(calls) == 1


def test_a_missing_file_and_a_bounded_wait(tmp_path):
    with pytest.raises(LoraError, match=r"LoRA 'c': No such file or directory: "):
        key_of(LoraSpec("c", str(tmp_path / "c.safetensors")))
    path = tmp_path / "d.safetensors"
    path.write_bytes(b"d")
    gate, before = threading.Event(), set(threading.enumerate())
    reader = LoraReads(lambda s: (gate.wait(30), _weights(s.name))[1], kept=1)
    key = key_of(LoraSpec("d", str(path)))
    reader.start(key)
    started = time.monotonic()
    reader.wait_any([key], 0.2)  # (the read waits for the gate: the wait ends at its bound)
    assert 0.15 < time.monotonic() - started < 5 and not reader.ready(key)
    gate.set()
    reader.wait_any([key], 30)
    assert reader.ready(key) and reader.result(key).name == "d"
    mine = [t for t in threading.enumerate() if t not in before and t.name.startswith("lora-")]
    reader.close()  # (its thread ends: nothing outlives the stage)
    for thread in mine:
        thread.join(5)
    assert len(mine) == 1 and not mine[0].is_alive()
    os.remove(path)

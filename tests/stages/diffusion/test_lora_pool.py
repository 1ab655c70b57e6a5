"""The LoRA pool of a stage (stages/diffusion/lora_pool.py) on the embedded tiny image model,
CPU fp32: its slots are held by running rows, evicted least recently used (never a held one)
and written in place; a join that fails lets its slots go; a file changed or broken on disk is
read again; a slow read does not stall the running rows, and a corrupt one fails its request
alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.stages.diffusion.lora_helpers import (
    lora_request,
    low_rank,
    run_images,
    tiny_image_pipe,
    wait_read,
    write_peft,
)
from vllm_omni_like.errors import InvalidRequestError, UnavailableError
from vllm_omni_like.params import LoraRef
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.faults import FaultInjector

pytestmark = pytest.mark.slow
A, B = (LoraRef("a"),), (LoraRef("b", 0.8),)


def test_the_pool_evicts_the_least_recently_used_idle_adapter_never_a_held_one(lora_stage):
    pool = lora_stage.runtime.denoise.loras
    assert pool is not None
    held = [pool.acquire((LoraRef(n),)) for n in ("a", "b", "kohya", "c")]  # 4 slots: full
    with pytest.raises(UnavailableError, match="all 4 LoRA slots"):
        pool.acquire((LoraRef("fast"),))
    assert not pool.pins.get(0) and sum(pool.pins.values()) == 4  # (the failed one holds none)
    pool.release(held[1])  # b is idle now: the one evicted
    loads = pool.loads
    fast = pool.acquire((LoraRef("fast"),))
    assert pool.loads == loads + 1 and "b" not in pool.slots and fast[0][0] == held[1][0][0]
    for selection in [held[0], held[2], held[3], fast]:
        pool.release(selection)
    assert not pool.pins
    again = pool.acquire((LoraRef("a"),))  # resident: no write
    assert pool.loads == loads + 1
    assert not pool.evict("a")  # (held by a row)
    pool.release(again)
    assert pool.evict("a") and "a" not in pool.slots and not pool.evict("a")
    pool.release(pool.acquire((LoraRef("a"),)))  # (written again into the freed slot)
    assert pool.loads == loads + 2


def test_a_join_that_fails_after_taking_its_slots_lets_them_go(lora_stage, monkeypatch):
    from vllm_omni_like.stages.diffusion import rows as rows_module

    pool = lora_stage.runtime.denoise.loras
    assert pool is not None
    real = rows_module.cat_rows
    calls = []

    def out_of_memory(*args):
        calls.append(1)
        raise torch.OutOfMemoryError("injected at the join")

    from vllm_omni_like.stages.diffusion.running_set import OwnLoopSet

    control = StageControl(FaultInjector((), "diffusion"), None)
    running = OwnLoopSet(lora_stage.runtime)
    running.join([lora_request("x", A)], control)  # (x holds a's slot while it runs)
    held = dict(pool.pins)
    monkeypatch.setattr(rows_module, "cat_rows", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):  # (a group joining a running set: concatenated)
        running.join([lora_request("y", B)], control)
    monkeypatch.setattr(rows_module, "cat_rows", real)
    assert calls and dict(pool.pins) == held  # y's slot for b let go; x's kept
    running.set.let_go()
    running.drained()
    assert not pool.pins


def test_a_join_that_finds_every_slot_held_fails_and_holds_nothing(lora_stage):
    pool = lora_stage.runtime.denoise.loras
    assert pool is not None
    held = [pool.acquire((LoraRef(n),)) for n in ("a", "b", "kohya", "c")]
    try:
        before = dict(pool.pins)
        batch = [lora_request("x", (LoraRef("a"),)), lora_request("y", (LoraRef("fast"),))]
        with pytest.raises(UnavailableError) as info:
            run_images(lora_stage, batch)
        assert info.value.code == "lora_pool_full"
        assert str(info.value) == (
            "all 4 LoRA slots (--max-loras) are held by running requests; 'fast' cannot be "
            "loaded now: retry"
        )
        assert dict(pool.pins) == before  # (x's hold on a was let go with the failed join)
    finally:
        for selection in held:
            pool.release(selection)
    assert not pool.pins


def test_a_file_broken_after_its_validation_fails_its_join_alone(lora_stage, lora_files):
    import os
    import shutil

    path = os.path.join(lora_files["dir"], "later.safetensors")
    shutil.copy(lora_files["c"], path)
    try:
        request = lora_request("x", (LoraRef("later"),))
        lora_stage.validate(request)  # (read and checked: fine)
        wait_read(lora_stage.runtime.denoise.loras, request.params.loras)
        with open(path, "wb") as f:
            f.write(b"\x00" * 16)  # (then the file changes under it)
        control = StageControl(FaultInjector((), "diffusion"), None)
        with pytest.raises(InvalidRequestError) as info:
            lora_stage.begin([request], control)
        assert info.value.code == "lora_unusable"
        assert str(info.value).startswith("LoRA 'later': later.safetensors cannot be read")
        assert not lora_stage.runtime.denoise.loras.pins
    finally:
        os.remove(path)


def test_a_resident_adapter_whose_file_changed_is_written_again_for_the_next_request(
    lora_stage, lora_files
):
    """A --lora-dir file changed on disk (size, mtime): the next request that names it gets it
    read and written again, into another slot while a running row holds the old one (which is
    freed when that row lets go)."""
    import os

    pool = lora_stage.runtime.denoise.loras
    assert pool is not None
    path = os.path.join(lora_files["dir"], "swap.safetensors")
    unet = tiny_image_pipe().unet
    write_peft(path, low_rank(unet, 7, 2))
    try:
        before = run_images(lora_stage, [lora_request("x", (LoraRef("swap"),), seed=9)])["x"]
        held = pool.acquire((LoraRef("swap"),))  # (a running row holds the first version)
        loads = pool.loads
        write_peft(path, low_rank(unet, 8, 4))  # (another rank: another size)
        again = pool.acquire((LoraRef("swap"),))
        assert pool.loads == loads + 1 and again[0][0] != held[0][0]
        assert held[0][0] not in pool.free  # (still held)
        pool.release(held)
        assert held[0][0] in pool.free and not pool.stale  # (freed once let go)
        pool.release(again)
        after = run_images(lora_stage, [lora_request("x", (LoraRef("swap"),), seed=9)])["x"]
        assert pool.loads == loads + 1  # (resident now: not written a third time)
        assert np.abs(after - before).mean() > 1  # (the new file's weights)
    finally:
        os.remove(path)
        pool.evict("swap")


def _gated(pool, monkeypatch):
    """The pool's reads wait for the returned event before reading (a slow disk)."""
    import threading

    gate, real = threading.Event(), pool.reads.read
    monkeypatch.setattr(pool.reads, "read", lambda spec: (gate.wait(60), real(spec))[1])
    return gate


def test_a_slow_read_does_not_stall_the_running_rows(lora_stage, lora_files, monkeypatch):
    """A request whose --lora-dir file is still being read waits in the running set while the
    rows already in it step (each step bounded); it joins at the boundary after its read."""
    import shutil
    import time

    from vllm_omni_like.stages.diffusion.running_set import OwnLoopSet

    pool = lora_stage.runtime.denoise.loras
    assert pool is not None
    path = f"{lora_files['dir']}/slow.safetensors"
    shutil.copy(lora_files["c"], path)
    gate = _gated(pool, monkeypatch)
    control = StageControl(FaultInjector((), "diffusion"), None)
    running = OwnLoopSet(lora_stage.runtime, defer_reads=True)
    try:
        running.join([lora_request("x", num_inference_steps=6)], control)
        slow = lora_request("y", (LoraRef("slow"),), num_inference_steps=2)
        lora_stage.validate(slow)  # (starts its read, which waits for the gate)
        running.join([slow], control)
        assert [r.request_id for r in running.stepping] == ["x"] and running.pending == [slow]
        for _ in range(3):  # the running row steps meanwhile
            started = time.monotonic()
            assert running.step(control, {"x", "y"}) and running.leave(control) is None
            assert time.monotonic() - started < 10
        assert not pool.ready(slow.params.loras)
        gate.set()
        wait_read(pool, slow.params.loras)
        assert running.leave(control) is None and not running.pending  # (joined at it)
        assert [r.request_id for r in running.stepping] == ["x", "y"]
        parts = []
        for _ in range(10):
            if not running.requests:
                break
            running.step(control, {"x", "y"})
            if (part := running.leave(control)) is not None:
                parts.append(part)
        outs = [o for p in parts for o in p.finish(p.requests)]
        assert sorted(o.request_id for o in outs) == ["x", "y"]
        assert all(o.error is None for o in outs)
    finally:
        gate.set()
        running.set.let_go()
        shutil.os.remove(path)
    assert not pool.pins


def test_a_corrupt_file_read_while_its_request_waits_fails_that_request_alone(
    lora_stage, lora_files, monkeypatch
):
    from vllm_omni_like.stages.diffusion.running_set import OwnLoopSet

    pool = lora_stage.runtime.denoise.loras
    assert pool is not None
    path = f"{lora_files['dir']}/rotten.safetensors"
    with open(path, "wb") as f:
        f.write(b"\x00" * 40)
    gate = _gated(pool, monkeypatch)
    control = StageControl(FaultInjector((), "diffusion"), None)
    running = OwnLoopSet(lora_stage.runtime, defer_reads=True)
    try:
        running.join([lora_request("x", num_inference_steps=4)], control)
        bad = lora_request("y", (LoraRef("rotten"),))
        lora_stage.validate(bad)  # (its read is under way: no verdict yet)
        running.join([bad], control)
        gate.set()
        wait_read(pool, bad.params.loras)
        assert running.step(control, {"x", "y"})
        part = running.leave(control)
        assert part is not None and [r.request_id for r in part.requests] == ["y"]
        (out,) = part.finish(part.requests)
        assert out.error is not None and out.error.code == "lora_unusable"
        assert out.error.message.startswith(
            "stage 'diffusion': LoRA 'rotten': rotten.safetensors cannot be read as safetensors"
        )
        assert [r.request_id for r in running.requests] == ["x"]  # (x steps on)
        with pytest.raises(InvalidRequestError) as info:  # (its verdict is kept: now at once)
            lora_stage.validate(lora_request("z", (LoraRef("rotten"),)))
        assert info.value.code == "lora_unusable"
    finally:
        gate.set()
        running.set.let_go()
        import os

        os.remove(path)
    assert not pool.pins

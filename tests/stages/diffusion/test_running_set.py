"""The running set in a worker (executor/running_set.py over the diffusion stage's
`OwnLoopSet`), in-process on the CPU with the tiny image model: groups join at a step boundary,
a request's image is the same alone or joined into a busy set at step k, an aborted request
leaves at the next step with its peers untouched, and a step that raises is bisected so only
its culprit fails."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from vllm_omni_like.config import FaultRule, StageConfig
from vllm_omni_like.errors import ErrorKind
from vllm_omni_like.executor.join_policy import JoinPolicy
from vllm_omni_like.executor.running_set import Group, RunningSet
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import Deferred, StageControl
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.stages.isolation import finish_parts
from vllm_omni_like.wire import ExecuteBatch, StageRequest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stage():
    s = DiffusionStage(
        StageConfig(name="diffusion", kind="diffusion", model="tiny-image", dtype="float32")
    )
    s.load("cpu")
    yield s
    s.close()


def _req(rid: str, seed: int, steps: int, prompt: str = "a red circle", **params):
    params = GenerationParams(seed=seed, num_inference_steps=steps, **params)
    return StageRequest(rid, prompt, params, mode="text2img")


class _Harness:
    """A RunningSet as the worker drives it, its outputs collected (decoded) per request."""

    def __init__(
        self,
        stage: DiffusionStage,
        faults: tuple[FaultRule, ...] = (),
        lanes: int = 1,
        group: tuple[int, float] = (1, 0.0),  # decode groups: rows, ms (default: at once)
    ) -> None:
        config = dataclasses.replace(
            stage.config, decode_group_rows=group[0], decode_group_ms=group[1]
        )
        stage.config = stage.runtime.config = config  # (the running set reads the runtime's)
        self.stage = stage
        self.control = StageControl(FaultInjector(faults, "diffusion"), self._progress)
        self.previews: dict[str, list[tuple[int, int]]] = {}  # request -> (its step, total)
        self.outputs: dict[str, StageOutput] = {}
        self.groups: list[int] = []  # in the order they left
        self.rows = RunningSet(
            stage,
            self.control,
            self._deliver,
            self._handed,
            self._valid,
            stage.stepped_modes(),
            JoinPolicy(lanes, budget=16),
        )
        self.stepped: list[list[int]] = []  # the groups of the lane each step stepped
        self.decodes: list[list[str]] = []  # the requests of each decode, in order

    def _progress(self, ids, step, total, previews, progress) -> None:
        for rid in previews:
            self.previews.setdefault(rid, []).append(progress[rid])

    def _deliver(self, batch_id: int, out: StageOutput) -> None:
        self.outputs[out.request_id] = out

    def _handed(self, part: Deferred | None, ended: list[Group], owners: dict[str, int]) -> None:
        self.groups += [group.batch_id for group in ended]
        if part is not None:
            assert set(owners) == {r.request_id for r in part.requests}
            self.decodes.append([r.request_id for r in part.requests])
            for out in finish_parts(self.stage, [part], self.control):
                self.outputs[out.request_id] = out

    def _valid(self, batch: ExecuteBatch) -> list[StageRequest]:
        return list(batch.requests)

    def add(self, batch_id: int, *requests: StageRequest) -> None:
        assert self.rows.takes(ExecuteBatch(batch_id, list(requests)))
        assert self.rows.add(ExecuteBatch(batch_id, list(requests)))  # (it joins at once)

    def steps(self, n: int | None = None) -> None:
        """`n` steps, or until the set drained."""
        done = 0
        while self.rows.running and (n is None or done < n):
            lane = self.rows.next_lane()
            self.stepped.append(lane.batch_ids)
            self.rows.step(lane)
            done += 1

    @property
    def batch_ids(self) -> list[int]:
        return [b for lane in self.rows.lanes for b in lane.batch_ids]

    @property
    def stepper(self):
        (lane,) = self.rows.lanes
        return lane.stepper

    def pixels(self, rid: str) -> np.ndarray:
        out = self.outputs[rid]
        assert out.error is None, out.error
        return out.images[0].pixels.astype(np.int16)


def _alone(stage: DiffusionStage, request: StageRequest) -> np.ndarray:
    h = _Harness(stage)
    h.add(1, request)
    h.steps()
    return h.pixels(request.request_id)


def test_a_request_that_joins_a_busy_set_at_step_k_makes_the_image_it_makes_alone(stage):
    a = _req("a", seed=3, steps=8)
    b = _req("b", seed=11, steps=5, prompt="a blue square", guidance_scale=1.0)
    c = _req("c", seed=5, steps=6, scheduler="euler-a")
    alone = {r.request_id: _alone(stage, r) for r in (a, b, c)}
    h = _Harness(stage)
    h.add(1, a)
    h.steps(3)  # a runs alone for 3 steps
    assert h.rows.running and h.batch_ids == [1]
    h.add(2, b, c)  # b and c join at this step boundary
    assert h.batch_ids == [1, 2]
    h.steps()
    assert not h.rows.running and sorted(h.groups) == [1, 2]
    for rid, image in alone.items():
        assert np.abs(h.pixels(rid) - image).max() <= 1, rid


def test_rows_of_stochastic_third_order_and_runge_kutta_solvers_join_and_make_theirs(stage):
    """A row whose steps draw noise from its generator (DPM++ 2M SDE), one of a third-order
    solver and one in PNDM's Runge-Kutta warm-up join a busy set at step k: each request's
    image is the one it makes alone."""
    a = _req("a", seed=3, steps=8, scheduler="dpm++3m")
    b = _req("b", seed=11, steps=5, prompt="a blue square", scheduler="dpm++2m-sde")
    c = _req("c", seed=5, steps=4, scheduler="pndm-prk", guidance_scale=1.0)
    d = _req("d", seed=6, steps=6, scheduler="unipc-3")
    alone = {r.request_id: _alone(stage, r) for r in (a, b, c, d)}
    h = _Harness(stage)
    h.add(1, a)
    h.steps(3)
    h.add(2, b, c, d)
    h.steps()
    assert sorted(h.groups) == [1, 2]
    for rid, image in alone.items():
        assert np.abs(h.pixels(rid) - image).max() <= 1, rid


def test_an_image_to_image_edit_joins_a_busy_text_set_and_makes_what_it_makes_alone(stage):
    """An edit of a size given shares text-to-image's shape group (one lane, one forward a
    step) and joins at a step boundary, starting at its strength's step; a multistep solver
    beside it is unaffected. Both images are the ones they make alone."""
    upload = np.arange(40 * 56 * 3, dtype=np.uint8).reshape(40, 56, 3)
    params = GenerationParams(seed=7, num_inference_steps=6, strength=0.5, width=32, height=32)
    edit = StageRequest("e", "a blue square", params, mode="edit", images=[upload])
    text = _req("t", seed=3, steps=7, scheduler="dpm++2m", width=32, height=32)
    alone = {r.request_id: _alone(stage, r) for r in (edit, text)}
    h = _Harness(stage)
    h.add(1, text)
    h.steps(2)
    h.add(2, edit)  # the same lane: its rows step in the text rows' forward
    assert [lane.batch_ids for lane in h.rows.lanes] == [[1, 2]]
    h.steps()
    assert sorted(h.groups) == [1, 2]
    for rid, image in alone.items():
        assert np.abs(h.pixels(rid) - image).max() <= 1, rid


def test_an_inpainting_edit_joins_a_busy_inpainting_set_and_makes_what_it_makes_alone(stage):
    """Inpainting rows are their own shape group (each step puts their unmasked region back):
    one that joins another's set at a step boundary, at another strength and schedule,
    makes the image it makes alone, and so does the one it joined."""
    upload = np.arange(40 * 56 * 3, dtype=np.uint8).reshape(40, 56, 3)
    mask = np.zeros((40, 56), np.uint8)
    mask[8:32, 10:40] = 255

    def inpaint(rid: str, seed: int, steps: int, strength: float, **params) -> StageRequest:
        p = GenerationParams(seed=seed, num_inference_steps=steps, strength=strength, **params)
        p = dataclasses.replace(p, width=32, height=32)
        return StageRequest(rid, "a blue square", p, mode="edit", images=[upload], mask=mask)

    first = inpaint("a", seed=7, steps=8, strength=0.75, scheduler="euler-a")
    later = inpaint("b", seed=9, steps=6, strength=1.0, scheduler="dpm++2m")
    alone = {r.request_id: _alone(stage, r) for r in (first, later)}
    h = _Harness(stage)
    h.add(1, first)
    h.steps(2)
    h.add(2, later)
    assert [lane.batch_ids for lane in h.rows.lanes] == [[1, 2]]
    h.steps()
    for rid, image in alone.items():
        assert np.abs(h.pixels(rid) - image).max() <= 1, rid


def test_the_sets_tensors_stay_inference_tensors_through_joins_and_leaves(stage):
    """A compiled model guards on its inputs' dispatch keys and was warmed up on inference
    tensors: a set's latents and text must stay such tensors when rows join (a cat), leave and
    are dropped (an index), outside any inference_mode of the caller."""
    h = _Harness(stage)
    h.add(1, _req("a", seed=1, steps=3, guidance_scale=1.0))
    h.steps(1)
    h.add(2, _req("b", seed=2, steps=5, guidance_scale=1.0), _req("c", seed=4, steps=6))
    joined = h.stepper.set
    assert joined.latents is not None and joined.latents.is_inference()
    assert all(t.is_inference() for t in _tensors(joined.text))
    h.steps(2)  # a ended: it left
    assert [r.request_id for r in h.stepper.requests] == ["b", "c"]
    assert joined.latents.is_inference() and all(t.is_inference() for t in _tensors(joined.text))
    h.control.abort(["c"])
    h.steps(1)  # c dropped
    assert joined.latents.is_inference() and all(t.is_inference() for t in _tensors(joined.text))
    h.steps()
    assert sorted(h.outputs) == ["a", "b"]


def _tensors(text) -> list[torch.Tensor]:
    return list(text.values()) if isinstance(text, dict) else [text]


def test_a_group_of_another_shape_waits_for_a_lane_to_drain(stage):
    """With one shape group a replica (`--shape-groups 1`) another shape waits, in order."""
    h = _Harness(stage)
    h.add(1, _req("a", seed=1, steps=4))
    other = ExecuteBatch(2, [_req("b", seed=2, steps=2, width=48, height=48)])
    assert not h.rows.add(other)  # another shape group: it waits
    assert h.batch_ids == [1] and list(h.rows.waiting) == [other]
    assert h.rows.next_waiting() is None  # not while the set runs
    h.steps()
    assert h.rows.next_waiting() is other  # the set drained: its turn


def test_another_shape_opens_a_lane_and_the_lanes_step_by_age_each_image_as_alone(stage):
    """Two shape groups a replica: a 48x48 request sent 2 steps into a 10-step 32x32 set opens
    a lane beside it; the lanes step in turn (the one that waited longest goes next), so the
    short one ends after its 3 steps (6 of the replica's), long before the set; a third shape
    waits for a lane to drain. Each image is the one it makes alone."""
    long_ = _req("long", seed=3, steps=10)
    short = _req("short", seed=4, steps=3, width=48, height=48)
    third = _req("third", seed=5, steps=2, width=40, height=40)
    alone = {r.request_id: _alone(stage, r) for r in (long_, short, third)}
    h = _Harness(stage, lanes=2)
    h.add(1, long_)
    h.steps(2)
    h.add(2, short)  # opens a second lane
    assert [lane.batch_ids for lane in h.rows.lanes] == [[1], [2]]
    waiting = ExecuteBatch(3, [third])
    assert not h.rows.add(waiting)  # a third shape: both lanes are taken
    assert list(h.rows.waiting) == [waiting] and h.rows.next_waiting() is None
    h.steps(6)
    assert h.stepped[2:] == [[1], [2], [1], [2], [1], [2]]  # in turn: the older wait first
    assert h.groups == [2] and "short" in h.outputs  # it ended; the long set runs on
    assert h.rows.next_waiting() is waiting  # its lane drained: the third may open one
    h.rows.place(waiting)
    h.steps()
    assert sorted(h.groups) == [1, 2, 3]
    for rid, image in alone.items():
        assert np.abs(h.pixels(rid) - image).max() <= 1, rid


def _two_steps_in(stage: DiffusionStage, steps: int) -> tuple[_Harness, np.ndarray]:
    """Requests a and b in one set, two steps in; and b's image made alone."""
    a, b = _req("a", seed=3, steps=steps), _req("b", seed=4, steps=steps)
    alone = _alone(stage, b)
    h = _Harness(stage)
    h.add(1, a, b)
    h.steps(2)
    return h, alone


def test_an_aborted_request_leaves_at_the_next_step_and_its_peers_are_untouched(stage):
    h, alone = _two_steps_in(stage, 6)
    h.control.abort(["a"])
    h.steps(1)
    assert [r.request_id for r in h.stepper.requests] == ["b"]  # a left at once
    assert h.control.steps_after_abort(["a"]) == {"a": 0}  # it never stepped after the abort
    h.steps()
    assert "a" not in h.outputs and np.abs(h.pixels("b") - alone).max() <= 1


def test_a_step_that_raises_fails_only_its_culprit_and_the_peers_finish_as_alone(stage):
    rule = FaultRule("diffusion", "step", "raise", match="@poison")
    a, b = _req("a", seed=3, steps=5), _req("b", seed=4, steps=5)
    bad = _req("bad", seed=5, steps=5, prompt="a circle @poison")
    alone = {r.request_id: _alone(stage, r) for r in (a, b)}
    h = _Harness(stage, (rule,))
    h.add(1, a, bad, b)
    h.steps()
    assert h.outputs["bad"].error is not None
    assert h.outputs["bad"].error.kind is ErrorKind.GENERATE
    assert "injected" in h.outputs["bad"].error.message
    for rid, image in alone.items():  # bisected from the same inputs: nothing else changed
        assert np.abs(h.pixels(rid) - image).max() <= 1, rid
    assert h.groups == [1]  # the group left once all of it had (the culprit included)


def test_a_join_that_raises_fails_its_culprit_and_the_rest_of_its_group_joins(stage):
    rule = FaultRule("diffusion", "execute", "raise", match="@nojoin")
    h = _Harness(stage, (rule,))
    h.add(1, _req("a", seed=1, steps=4))
    h.steps(1)
    h.add(2, _req("b", seed=2, steps=3), _req("x", seed=3, steps=3, prompt="x @nojoin"))
    assert h.outputs["x"].error is not None  # at once, before any step
    assert sorted(r.request_id for r in h.stepper.requests) == ["a", "b"]
    h.steps()
    assert h.outputs["a"].error is None and h.outputs["b"].error is None


def test_a_row_whose_latents_turn_nan_fails_alone_at_its_decode(stage):
    h, alone = _two_steps_in(stage, 4)
    rows = h.stepper.set  # a's row goes bad (an overflow in the model, say)
    first = rows.first_rows()["a"]
    with torch.inference_mode():
        rows.latents[first] = float("nan")
    h.steps()
    error = h.outputs["a"].error
    assert error is not None and error.kind is ErrorKind.GENERATE
    assert "not finite (NaN or inf)" in error.message
    assert np.abs(h.pixels("b") - alone).max() <= 1  # its peer decoded as alone


def test_a_request_that_joins_later_gets_its_partial_images_at_its_own_steps(stage):
    h = _Harness(stage)
    h.add(1, _req("a", seed=1, steps=8))
    h.steps(3)
    h.add(2, _req("b", seed=2, steps=4, partial_images=1))  # 1 preview: after its step 2 of 4
    h.steps()
    assert h.previews == {"b": [(2, 4)]}  # while the set was at a's step 5
    assert h.outputs["b"].error is None


def test_a_set_from_its_first_join_to_its_drain_is_one_batch_of_the_timeline(stage, tmp_path):
    tracer = stage.runtime.tracer
    tracer.directory, tracer.batches = str(tmp_path), set()  # timelines only, no profiler
    try:
        h = _Harness(stage)
        h.add(1, _req("a", seed=1, steps=4))
        h.steps(2)
        h.add(2, _req("b", seed=2, steps=3))
        h.steps()
        lines = (tmp_path / "diffusion-rank0-timeline.jsonl").read_text().splitlines()
    finally:
        tracer.directory = ""
    assert len(lines) == 1
    labels = json.loads(lines[0])["labels"]
    # a's 4 steps, b's 3 from a's step 3: 5 steps of the set, each join's text encoders and
    # noise between its own marks (not inside a step's)
    assert labels == ["begin", "joined", "step", "step", "joined"] + ["step"] * 3 + ["synced"]


def test_a_first_join_that_fails_closes_the_timeline_it_opened(stage, tmp_path, monkeypatch):
    tracer = stage.runtime.tracer
    tracer.directory, tracer.batches = str(tmp_path), set()
    rows = stage.runtime.denoise.rows

    def failing(batch, *args):
        if any(r.prompt == "boom" for r in batch):
            raise RuntimeError("text encoder failed")
        return rows(batch, *args)

    monkeypatch.setattr(stage.runtime.denoise, "rows", failing)
    try:
        h = _Harness(stage)
        h.add(1, _req("x", seed=1, steps=2, prompt="boom"))
        assert "text encoder failed" in str(h.outputs["x"].error)
        assert not h.rows.running and tracer.sharing == 0
        assert not (tmp_path / "diffusion-rank0-timeline.jsonl").exists()
        h.add(2, _req("y", seed=2, steps=2))
        h.steps()
        lines = (tmp_path / "diffusion-rank0-timeline.jsonl").read_text().splitlines()
    finally:
        tracer.directory = ""
    assert h.outputs["y"].error is None
    assert [json.loads(line)["labels"] for line in lines] == [
        ["begin", "joined", "step", "step", "synced"]
    ]


def test_the_requests_that_end_at_one_step_decode_together(stage):
    h = _Harness(stage)
    h.add(1, _req("a", seed=1, steps=3), _req("b", seed=2, steps=3))
    h.add(2, _req("c", seed=3, steps=3), _req("d", seed=4, steps=5))
    h.steps()
    assert h.decodes == [["a", "b", "c"], ["d"]]  # one decode a step, across groups
    assert h.groups == [1, 2]  # group 1 ended with the first, group 2 with d


def test_finished_rows_wait_for_their_decode_group_then_decode_together(stage, monkeypatch):
    """Decode groups of 3 rows or 100 ms (a step takes 40 ms on a fake clock): a and b end at
    steps 2 and 3 and stay in the set, held, until the first of them waited 100 ms (step 5);
    c and d, ending at steps 6 and 7, decode when the set drains. A group ends only once its
    requests were decoded, and each image is the one it makes alone."""
    from vllm_omni_like.stages.diffusion import running_set

    clock = {"t": 0.0}
    monkeypatch.setattr(running_set, "_now", lambda: clock["t"])
    reqs = [_req("a", 1, 2), _req("b", 2, 3), _req("c", 3, 6), _req("d", 4, 7)]
    alone = {r.request_id: _alone(stage, r) for r in reqs}
    h = _Harness(stage, group=(3, 100.0))
    h.add(1, *reqs[:2])
    h.add(2, *reqs[2:])
    for step in range(1, 5):
        clock["t"] = 0.04 * step
        h.steps(1)
    assert h.decodes == [] and h.groups == []  # a and b are held: their group has not ended
    assert sorted(r.request_id for r in h.stepper.requests) == ["a", "b", "c", "d"]
    clock["t"] = 0.2
    h.steps(1)
    assert h.decodes == [["a", "b"]] and h.groups == [1]
    clock["t"] = 0.24
    h.steps()
    assert h.decodes == [["a", "b"], ["c", "d"]] and h.groups == [1, 2]
    for rid, image in alone.items():
        assert np.abs(h.pixels(rid) - image).max() <= 1, rid

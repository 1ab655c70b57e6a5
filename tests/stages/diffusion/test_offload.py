"""`--offload idle-expert` without a model: the swap policy (expert_policy.py) as numbers, and the
swap itself (offload.py) over two tiny block models with a fake transfer (offload_fakes.py):
where each expert's tensors are, which copies a step waits for, the prefetch, a failed copy,
and the refusals at start-up."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from tests.stages.diffusion.offload_fakes import FakeTransfer, TwoExperts
from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.models.adapter import Expert
from vllm_omni_like.models.row_schedulers import Row, Schedule
from vllm_omni_like.stages.diffusion import offload as offload_module
from vllm_omni_like.stages.diffusion.expert_policy import (
    HIGH,
    LOW,
    MAX_WAIT_STEPS,
    SwapPolicy,
    after,
    choose,
)
from vllm_omni_like.stages.diffusion.offload import PREFETCH_UNITS, ExpertOffload
from vllm_omni_like.wire import Mode

BOUNDARY = 875.0


# ---- the policy ------------------------------------------------------------------------------
def test_the_expert_of_a_timestep_is_the_adapters_rule():
    """The offload asks the adapter (`Adapter.expert_for`): Wan's rule, the boundary still
    the high-noise expert's (tests/models/test_wan22.py holds it to the pipeline's calls)."""
    adapter = TwoExperts([_Model(0), _Model(1)], BOUNDARY)
    assert adapter.expert_for(875.0) == HIGH
    assert adapter.expert_for(874.9) == LOW
    offload = ExpertOffload(adapter, FakeTransfer(), SwapPolicy())  # type: ignore[arg-type]  # (an adapter's two methods)
    assert offload.expert_for(874.9) == LOW


@pytest.mark.parametrize(
    "resident,needs,waited,want",
    [
        (HIGH, [HIGH, HIGH], 0, HIGH),  # every row needs the resident one
        (HIGH, [LOW, LOW], 0, LOW),  # none does: swap
        (HIGH, [HIGH, LOW], 0, HIGH),  # the low row waits...
        (HIGH, [HIGH, LOW], MAX_WAIT_STEPS - 1, HIGH),
        (HIGH, [HIGH, LOW], MAX_WAIT_STEPS, LOW),  # ...at most MAX_WAIT_STEPS steps
        (LOW, [HIGH, LOW], MAX_WAIT_STEPS, HIGH),
        (None, [HIGH, LOW], 0, HIGH),  # none resident (a failed swap): most rows', high on a tie
        (None, [LOW, LOW, HIGH], 0, LOW),
    ],
)
def test_choose(resident, needs, waited, want):
    assert choose(resident, needs, waited, MAX_WAIT_STEPS) == want


def test_waited_counts_from_the_swap_and_resets_when_none_waits():
    assert after(HIGH, HIGH, [HIGH, LOW], 2) == 3
    assert after(HIGH, LOW, [HIGH, LOW], 3) == 1  # (swapped: the high row waits now)
    assert after(HIGH, HIGH, [HIGH], 3) == 0


def test_no_row_waits_more_than_the_bound_while_new_rows_keep_joining():
    """A set fed a new high-noise row every step (each 2 high steps, then 2 low): each step, one
    expert's rows step; no row ever waits more than MAX_WAIT_STEPS steps in a row, and every
    row ends."""
    policy, resident = SwapPolicy(), HIGH
    rows: list[list[int]] = []  # each row's remaining needs
    waits: list[int] = []
    longest, ended = 0, 0
    for step in range(200):
        if step < 150:
            rows.append([HIGH, HIGH, LOW, LOW])
            waits.append(0)
        if not rows:
            break
        needs = [r[0] for r in rows]
        chosen = policy.choose(resident, needs)
        policy.stepped(resident, chosen, needs)
        resident = chosen
        for i, r in enumerate(rows):
            waits[i] = 0 if r[0] == chosen else waits[i] + 1
            longest = max(longest, waits[i])
            if r[0] == chosen:
                r.pop(0)
        keep = [i for i, r in enumerate(rows) if r]
        ended += len(rows) - len(keep)
        rows, waits = [rows[i] for i in keep], [waits[i] for i in keep]
    assert ended == 150 and not rows
    assert longest <= MAX_WAIT_STEPS


def test_upcoming_names_the_swap_of_the_next_step():
    policy = SwapPolicy()
    assert policy.upcoming(HIGH, HIGH, [HIGH], [LOW]) == LOW  # the row crosses the boundary
    assert policy.upcoming(HIGH, HIGH, [HIGH], [HIGH]) is None
    assert policy.upcoming(HIGH, HIGH, [HIGH], []) is None  # (its last step)


# ---- the swap ------------------------------------------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.register_buffer("table", torch.ones(4), persistent=False)  # (stays: derived)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale + self.table


class _Model(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(4, 4)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x


def _offload(transfer: FakeTransfer) -> tuple[ExpertOffload, list[torch.nn.Module]]:
    models: list[torch.nn.Module] = [_Model(0), _Model(1)]
    return ExpertOffload(TwoExperts(models, BOUNDARY), transfer, SwapPolicy()), models  # type: ignore[arg-type]  # (an adapter's two methods)


SLOTS = 2 + 3 * 3  # embed (2), each block's linear (2) and persistent buffer (1)


def test_one_expert_is_on_the_device_and_the_idle_one_refuses_a_call():
    transfer = FakeTransfer()
    offload, models = _offload(transfer)
    x = torch.randn(2, 4)
    want = [m(x) for m in (_Model(0), _Model(1))]
    assert offload.resident == HIGH and transfer.held(offload) == 0  # (the load's tensors stay its)
    assert torch.equal(models[0](x), want[0])
    with pytest.raises(RuntimeError, match="transformer_2 was called while it waits in host"):
        models[1](x)
    offload.swap_to(LOW)
    assert (
        transfer.held(offload) == SLOTS and transfer.begins == 1
    )  # (the copy stream waited first)
    assert torch.equal(models[1](x), want[1])  # the copies are the weights
    assert transfer.waited == [2, 3, 4, 5]  # each unit's mark, in the order the forward runs
    with pytest.raises(RuntimeError, match="transformer was called"):
        models[0](x)
    offload.swap_to(HIGH)
    assert transfer.held(offload) == SLOTS  # the low-noise copies let go: one expert held
    assert torch.equal(models[0](x), want[0])
    report = offload.report()
    assert (report.resident, report.swaps, report.mode) == ("transformer", 2, "idle-expert")
    assert report.device_bytes == report.host_bytes // 2 and report.last_swap_s is not None
    table = models[1].blocks[0].table
    assert table is models[1].blocks[0]._buffers["table"]  # (not moved: non-persistent)


def test_a_prefetch_copies_the_first_units_and_the_swap_takes_them():
    transfer = FakeTransfer()
    offload, models = _offload(transfer)
    offload.prefetch(LOW)
    staged = transfer.copies
    assert staged == 2 + 3  # the head (embed) and the first block
    assert offload.device_bytes() > 0 and offload.resident == HIGH
    offload.swap_to(LOW)
    assert transfer.copies == SLOTS  # the prefetched units are not copied again
    x = torch.randn(1, 4)
    assert torch.equal(models[1](x), _Model(1)(x))
    assert transfer.waited[:PREFETCH_UNITS] == [1, 2]  # the prefetch's marks, then the swap's


def test_a_prefetch_no_step_took_is_dropped():
    transfer = FakeTransfer()
    offload, _ = _offload(transfer)
    offload.prefetch(LOW)
    assert transfer.held(offload) == 5
    offload.release()
    assert transfer.held(offload) == 0 and offload.resident == HIGH


def test_a_swap_time_is_read_once_both_its_marks_are_reached():
    """CudaTransfer.seconds asks both events: with every unit prefetched the swap's `end` (its
    last unit's copy, at the prefetch) was recorded before its `start`, so `end` may be reached
    while `start` is not (CUDA's elapsed_time would raise then)."""

    class Event:
        def __init__(self, reached: bool) -> None:
            self.reached = reached

        def query(self) -> bool:
            return self.reached

        def elapsed_time(self, end: Event) -> float:
            assert self.reached and end.reached, "elapsed_time of an event not reached"
            return 1500.0

    transfer = object.__new__(offload_module.CudaTransfer)  # (no CUDA stream: not asked)
    assert transfer.seconds(Event(True), Event(True)) == 1.5
    assert transfer.seconds(Event(False), Event(True)) is None  # (end recorded first)
    assert transfer.seconds(Event(True), Event(False)) is None


def test_a_copy_that_fails_leaves_neither_expert_resident_and_the_next_swap_works():
    transfer = FakeTransfer(fail_at=4)
    offload, models = _offload(transfer)
    with pytest.raises(torch.OutOfMemoryError):
        offload.swap_to(LOW)
    assert offload.resident is None and transfer.held(offload) == 0  # nothing held on the device
    assert offload.report().resident is None
    with pytest.raises(RuntimeError, match="transformer was called"):
        models[0](torch.randn(1, 4))
    offload.swap_to(LOW)
    x = torch.randn(1, 4)
    assert torch.equal(models[1](x), _Model(1)(x)) and transfer.held(offload) == SLOTS


def test_a_step_picks_the_rows_of_one_expert_and_prefetches_before_the_switch():
    transfer = FakeTransfer()
    offload, _ = _offload(transfer)
    times = torch.tensor([999.0, 900.0, 800.0, 700.0])
    schedule = Schedule("flow-euler", 4, times, tables=None, init_noise_sigma=1.0)  # type: ignore[arg-type]  # (no tables: no step runs)

    @dataclasses.dataclass
    class _Row:
        state: Row

    rows = [_Row(Row(schedule, index=1)), _Row(Row(schedule, index=2))]  # 900 (high), 800 (low)
    active, chosen, needs = offload.pick(rows, [0, 1])  # type: ignore[arg-type]  # (rows' state)
    assert (active, chosen, needs) == ([0], HIGH, [HIGH, LOW])
    assert LOW in offload.staged  # row 0 crosses the boundary next: the next step swaps
    offload.stepped(HIGH, chosen, needs)
    rows[0].state.index = 2
    active, chosen, _ = offload.pick(rows, [0, 1])  # type: ignore[arg-type]
    assert (active, chosen, offload.swaps) == ([0, 1], LOW, 1)


# ---- refusals --------------------------------------------------------------------------------
def _config(**more) -> StageConfig:
    base = {"name": "video", "kind": "diffusion", "offload": "idle-expert", "shape_groups": 1}
    return StageConfig(**base | more)


@pytest.mark.parametrize(
    "more,message",
    [
        ({"offload": "all"}, "offload must be one of none, idle-expert, not 'all'"),
        ({"kind": "llm"}, "--offload idle-expert runs diffusion stages only"),
        ({"compile": True}, "--offload idle-expert: not with --compile yet"),
        ({"cfg_parallel": True}, "not with --cfg-parallel or --sequence-parallel"),
        (
            {"sequence_parallel": 2, "device": "cpu"},
            "stage 'video': --offload idle-expert: not with --cfg-parallel or "
            "--sequence-parallel (the ranks' denoiser calls follow rank 0's rows: each rank "
            "would have to swap its expert with rank 0's)",
        ),
        (
            {"shape_groups": 2},
            "stage 'video': --offload idle-expert: not with --shape-groups 2 (each lane of the "
            "running set would swap the one expert on the device for its own rows: lanes "
            "needing different experts would swap it at every step, and their rows' waits "
            "would not be bounded); pass --shape-groups 1",
        ),
    ],
)
def test_the_config_refuses_what_it_does_not_run(more, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _config(**more)


def test_one_lane_is_asked_of_the_step_level_set_only():
    """A batch that runs whole (`--batch-level request`) has no lanes: its shape groups do not
    matter; the step-level set's default (2 lanes) is refused until the user says 1."""
    assert _config(batch_level="request", shape_groups=3).offload == "idle-expert"
    with pytest.raises(ConfigError, match=re.escape("--shape-groups 2 (each lane")):
        StageConfig(name="video", kind="diffusion", offload="idle-expert")


def test_a_model_of_one_denoiser_or_a_cpu_device_is_refused():
    class _One:
        def experts(self) -> list[Expert]:
            return [Expert("transformer", _Model(0))]

    config = _config()
    with pytest.raises(ConfigError, match="this model has one denoiser \\(transformer\\)"):
        offload_module.build(config, _One(), torch.device("cpu"), set())  # type: ignore[arg-type]  # (an adapter's experts)
    with pytest.raises(ConfigError, match="--offload idle-expert needs a CUDA device: on cpu"):
        offload_module.check_device(config, torch.device("cpu"))
    offload_module.check_device(dataclasses.replace(config, offload="none"), torch.device("cpu"))


def test_a_mode_the_pipelines_own_call_runs_is_refused_at_the_load():
    """A mode whose rows run the pipeline's own call (it calls both experts in one call) is
    refused before anything is offloaded (no CUDA is needed to refuse it)."""

    two = TwoExperts([_Model(0), _Model(1)], BOUNDARY)
    modes = {Mode.INPAINT, Mode.EDIT}
    with pytest.raises(ConfigError) as info:
        offload_module.build(_config(), two, torch.device("cuda"), modes)  # type: ignore[arg-type]  # (an adapter's experts)
    assert str(info.value) == (
        "stage 'video': --offload idle-expert: edit, inpaint would run the pipeline's own "
        "call, which calls both experts; the offload runs our own loop's modes only"
    )


def test_offload_is_a_stage_field_of_the_flags_and_of_yaml(tmp_path):
    """`--offload idle-expert` overrides every diffusion stage (an LLM stage in front keeps
    none); a YAML stage says `offload: idle-expert` for itself."""
    from vllm_omni_like.cli import build_parser
    from vllm_omni_like.flags import stage_overrides
    from vllm_omni_like.pipelines.catalog import resolve

    flags = ["serve", "tiny-omni", "--offload", "idle-expert", "--shape-groups", "1"]
    args = build_parser().parse_args(flags)
    assert stage_overrides(args) == {"offload": "idle-expert", "shape_groups": 1}
    llm, diffusion = resolve("tiny-omni", **stage_overrides(args))[0].stages
    assert (llm.offload, diffusion.offload) == ("none", "idle-expert")
    assert StageConfig(name="d", kind="diffusion").offload == "none"
    yaml_file = tmp_path / "p.yaml"
    yaml_file.write_text(
        "pipelines:\n  - name: v\n    output: video\n    stages:\n"
        "      - {name: diffusion, kind: diffusion, model: tiny-video, offload: idle-expert,"
        " shape_groups: 1}\n"
    )
    (stage,) = resolve(str(yaml_file))[0].stages
    assert stage.offload == "idle-expert"


def test_the_arena_holds_each_master_whole_and_aligned():
    """CUDA's masters are views of one page-locked arena (CudaTransfer.masters): each tensor's
    bytes at an aligned offset, its dtype and shape (FP8 values and a scalar among them)."""
    from vllm_omni_like.stages.diffusion.offload import ALIGN, arena_bytes, in_arena

    tensors = [
        torch.randn(3, 5, dtype=torch.bfloat16),
        torch.randn(7).to(torch.float8_e4m3fn),
        torch.tensor(2.5),
        torch.arange(6, dtype=torch.int64).reshape(2, 3),
    ]
    total = arena_bytes(tensors)
    assert total == 4 * ALIGN  # (each under ALIGN bytes: one aligned slot each)
    arena = torch.zeros(total, dtype=torch.uint8)
    views = in_arena(arena, tensors)
    for view, t in zip(views, tensors, strict=True):
        assert view.dtype == t.dtype and view.shape == t.shape
        assert torch.equal(view.view(torch.uint8), t.view(torch.uint8)) if t.dim() else view == t
        assert view.untyped_storage().data_ptr() == arena.data_ptr()  # (one arena)
        assert (view.data_ptr() - arena.data_ptr()) % ALIGN == 0

import pytest

from vllm_omni_like.config import FaultRule
from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.stages.faults import (
    FaultInjector,
    InjectedFault,
    InjectedOutOfMemory,
    hash_fraction,
    selects,
)
from vllm_omni_like.wire import StageRequest


def _req(i: int, prompt: str = "a cat") -> StageRequest:
    return StageRequest(f"req-{i}", prompt)


def test_match_selector_fires_only_for_the_marker():
    rule = FaultRule("diffusion", "execute", "raise", match="@fail")
    assert selects(rule, _req(1, "draw @fail now"))
    assert not selects(rule, _req(1, "draw now"))


def test_fraction_selector_is_stable_and_close_to_p():
    rule = FaultRule("diffusion", "execute", "raise", p=0.1, seed=7)
    hits = [selects(rule, _req(i)) for i in range(4000)]
    assert 0.08 < sum(hits) / len(hits) < 0.12
    assert hits == [selects(rule, _req(i)) for i in range(4000)]  # a re-run hits again
    other = FaultRule("diffusion", "execute", "raise", p=0.1, seed=8)
    assert hits != [selects(other, _req(i)) for i in range(4000)]
    assert hash_fraction(7, "req-1", "diffusion", "execute") != hash_fraction(
        7, "req-1", "diffusion", "step"
    )


@pytest.mark.parametrize(
    ("kind", "exc"),
    [("raise", InjectedFault), ("invalid", InvalidRequestError), ("oom", InjectedOutOfMemory)],
)
def test_recoverable_kinds_raise_their_error(kind, exc):
    inj = FaultInjector([FaultRule("diffusion", "step", kind, match="@x")], "diffusion")
    inj.fire("step", [_req(1)])  # not selected: nothing happens
    inj.fire("execute", [_req(1, "@x")])  # another point: nothing happens
    with pytest.raises(exc, match="injected"):
        inj.fire("step", [_req(1), _req(2, "@x")])
    assert inj.fired == {kind: 1}


def test_rules_of_other_stages_are_ignored():
    inj = FaultInjector([FaultRule("llm", "execute", "raise")], "diffusion")
    inj.fire("execute", [_req(1)])
    assert inj.rules == []


def test_load_rules_fire_without_a_request():
    inj = FaultInjector([FaultRule("llm", "load", "raise")], "llm")
    with pytest.raises(InjectedFault, match="at load"):
        inj.fire_load()

import pytest

from vllm_omni_like.config import FAULTS_ENV, FaultRule, StageConfig, faults_from_env, parse_faults
from vllm_omni_like.errors import InvalidRequestError


def test_fault_rules_parse_both_selectors():
    rules = parse_faults(
        "stage=diffusion,point=execute,kind=raise,match=@fail;"
        " stage=llm,point=step,kind=oom,p=0.1,seed=7"
    )
    assert rules == (
        FaultRule("diffusion", "execute", "raise", match="@fail"),
        FaultRule("llm", "step", "oom", p=0.1, seed=7),
    )


@pytest.mark.parametrize(
    "text",
    [
        "stage=diffusion,point=nowhere,kind=raise",
        "stage=diffusion,point=execute,kind=explode",
        "stage=diffusion,kind=raise",
        "stage=diffusion,point=execute,kind=raise,p=1.5",
        "stage=diffusion,point=execute,kind=raise,colour=red",
        "stage=diffusion;point",
    ],
)
def test_bad_fault_rules_are_refused(text):
    with pytest.raises(ValueError):
        parse_faults(text)


def test_faults_are_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, "stage=s,point=load,kind=exit")
    assert faults_from_env() == (FaultRule("s", "load", "exit"),)
    monkeypatch.delenv(FAULTS_ENV)
    assert faults_from_env() == ()


def test_stage_config_checks_its_fields():
    with pytest.raises(InvalidRequestError, match="kind must be one of"):
        StageConfig(name="x", kind="magic")
    with pytest.raises(InvalidRequestError, match="replicas"):
        StageConfig(name="x", kind="null", replicas=0)
    assert StageConfig(name="x", kind="tests.stage_helpers:CountingStage").kind.endswith("Stage")

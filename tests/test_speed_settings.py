"""The speed settings refused at start-up (speed_settings.py): a step cache of an unknown kind
or decision, a negative threshold, beside CFG-parallel or sequence parallelism or a whole-model
compile, outside a diffusion stage; what /health says of it; a request's own threshold."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.protocol.schemas import ImageRequest, VideoRequest
from vllm_omni_like.speed_settings import describe_cache


def _config(**kw) -> StageConfig:
    return StageConfig(name="d", kind="diffusion", model="tiny-video", **kw)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"cache": "teacache"}, "cache must be one of none, first-block, not 'teacache'"),
        ({"cache": "first-block", "cache_decision": "late"}, "cache_decision must be one of"),
        ({"cache": "first-block", "cache_threshold": -0.1}, "--cache-threshold must be >= 0"),
        (
            {"cache": "first-block", "cfg_parallel": True, "devices": ("cpu", "cpu")},
            "not with --cfg-parallel or --sequence-parallel yet",
        ),
        (
            {"cache": "first-block", "sequence_parallel": 2, "device": "cpu"},
            "not with --cfg-parallel or --sequence-parallel yet",
        ),
        (
            {"cache": "first-block", "compile": True, "regional_compile": "off"},
            "not with --regional-compile off",
        ),
        (
            {"cache": "first-block", "compile": True, "cuda_graphs": "on"},
            "not with --cuda-graphs on",
        ),
        ({"cache": "first-block", "lora_dir": "/tmp"}, "nor with LoRA adapters yet"),
    ],
)
def test_a_step_cache_it_cannot_run_is_refused_naming_the_flag(kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as caught:
        _config(**kw)
    assert "stage 'd'" in str(caught.value)


def test_a_step_cache_runs_diffusion_stages_only():
    with pytest.raises(ConfigError, match="--cache first-block runs diffusion stages only"):
        StageConfig(name="llm", kind="llm", cache="first-block")
    with pytest.raises(ConfigError, match="--quantization fp8 runs diffusion stages only"):
        StageConfig(name="llm", kind="llm", quantization="fp8")


def test_a_cached_stage_compiles_block_by_block_and_health_describes_it():
    config = _config(cache="first-block", compile=True)
    assert config.regional and not _config(compile=True).regional
    # (the decisions' defaults: the H100 sweep of bench/cache_quality.py)
    assert describe_cache(config) == {"mode": "first-block", "threshold": 0.1, "decision": "lagged"}
    sync = describe_cache(_config(cache="first-block", cache_decision="sync"))
    assert sync == {"mode": "first-block", "threshold": 0.05, "decision": "sync"}
    own = _config(cache="first-block", cache_decision="lagged", cache_threshold=0.0)
    assert describe_cache(own) == {"mode": "first-block", "threshold": 0.0, "decision": "lagged"}
    assert describe_cache(_config()) is None


def test_a_request_sends_its_own_threshold():
    assert ImageRequest(prompt="x", cache={"threshold": 0.2}).cache_threshold() == 0.2
    assert VideoRequest(prompt="x").cache_threshold() is None
    with pytest.raises(ValidationError):
        ImageRequest(prompt="x", cache={"threshold": -1})
    with pytest.raises(ValidationError):
        ImageRequest(prompt="x", cache={"threshold": 0.1, "other": 1})

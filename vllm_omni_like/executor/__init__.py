"""Executors: run the worker processes of one stage replica."""

from __future__ import annotations

from collections.abc import Callable

from vllm_omni_like.config import EngineConfig
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.executor.base import Executor, FailureCallback
from vllm_omni_like.executor.multiproc import MultiprocExecutor


def factory_for(config: EngineConfig) -> Callable[..., Executor]:
    """The executor class `config.executor` names (Ray's, connected to `ray_address`)."""
    if config.executor == "multiproc":
        if config.ray_address:
            raise ConfigError("--ray-address needs --executor ray")
        return MultiprocExecutor
    if config.executor != "ray":
        raise ConfigError(f"unknown executor {config.executor!r}: multiproc or ray")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError("--executor ray needs Ray: pip install 'vllm-omni-like[ray]'") from None
    for pipeline in config.pipelines:
        for stage in pipeline.stages:
            if stage.leads:
                raise ConfigError(
                    f"stage {stage.name!r}: --cfg-parallel and --sequence-parallel run on the "
                    "multiproc executor only"
                )
    from vllm_omni_like.executor import ray_runtime
    from vllm_omni_like.executor.ray_executor import RayExecutor

    if config.ray_address:
        ray_runtime.configure(config.ray_address)
    ray_runtime.ray_module()  # connected now, on this thread (see ray_module)
    return RayExecutor


def release(config: EngineConfig) -> None:
    """After every executor stopped: leave the Ray cluster (a local one stops)."""
    if config.executor == "ray":
        from vllm_omni_like.executor import ray_runtime

        ray_runtime.shutdown()


__all__ = ["Executor", "FailureCallback", "MultiprocExecutor", "factory_for", "release"]

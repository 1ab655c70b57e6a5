"""Executors: run the worker processes of one stage replica."""

from vllm_omni_like.executor.base import Executor, FailureCallback
from vllm_omni_like.executor.multiproc import MultiprocExecutor

__all__ = ["Executor", "FailureCallback", "MultiprocExecutor"]

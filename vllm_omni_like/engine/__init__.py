"""The engine: AsyncOmni on the event loop, the orchestrator thread, stage pools."""

from vllm_omni_like.engine.async_omni import AsyncOmni, Omni, new_request_id

__all__ = ["AsyncOmni", "Omni", "new_request_id"]

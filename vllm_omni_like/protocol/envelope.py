"""The OpenAI error envelope: how an error is written for a client (HTTP or a batch line)."""

from __future__ import annotations

from typing import Any

from vllm_omni_like.errors import ErrorInfo


def envelope(info: ErrorInfo, request_id: str | None) -> dict[str, Any]:
    return {
        "error": {
            "message": info.message,
            "type": info.type,
            "param": info.param,
            "code": info.code,
            "request_id": request_id,
            "stage": info.stage,
        }
    }

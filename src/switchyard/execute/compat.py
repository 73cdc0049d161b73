"""Fallback compatibility: can this model honour this request?

Checked for every target at request time (and the impossible cases at config load,
in `config/checks.py` and `config/models.py`). An incompatible fallback changes the
failure rather than fixing it, so it is skipped with the reason recorded.
"""

from __future__ import annotations

from typing import Any

from switchyard.config import ModelConfig
from switchyard.engines.token_ids import refusal as token_ids_refusal
from switchyard.request import Generation


def request_needs(req: Generation, prompt_tokens: int, max_tokens: int) -> dict[str, Any]:
    rf = req.response_format
    vision = any(
        isinstance(m.get("content"), list)
        and any(
            isinstance(p, dict) and p.get("type") in ("image_url", "input_image")
            for p in m["content"]
        )
        for m in req.messages or ()
    )
    return {
        "tokens": prompt_tokens + max_tokens,
        "tools": bool(req.tools or req.functions),
        "json_schema": isinstance(rf, dict) and rf.get("type") in ("json_schema", "json_object"),
        "streaming": req.stream,
        "vision": vision,
        "token_ids": req.return_token_ids is True,
        "n": req.n,
    }


def incompatibility(
    needs: dict[str, Any], model: ModelConfig, boundary: list[str] | None
) -> str | None:
    """Why `model` cannot serve a request with `needs`, or None if it can."""
    cap = model.capabilities
    if needs["tokens"] > cap.context_window:
        return f"context window {cap.context_window} < {needs['tokens']} tokens needed"
    if needs["tools"] and not cap.supports_tools:
        return "does not support tool calling"
    if needs["json_schema"] and not cap.supports_json_schema:
        return "does not support JSON schema output"
    if needs["streaming"] and not cap.supports_streaming:
        return "does not support streaming"
    if needs["vision"] and not cap.supports_vision:
        return "does not support image input"
    if needs["token_ids"]:
        why = token_ids_refusal(model, needs["streaming"], needs["n"])
        if why is not None:
            return why
    if boundary is not None and model.region not in boundary:
        return f"region {model.region!r} is outside the allowed {boundary}"
    return None

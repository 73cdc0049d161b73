"""Stages of the request path timed on their own, outside the driven apps: the
duplicate-key check every JSON body passes (api/body.py), on a realistic agent chat
body (AGENT_CHAT) rather than the driven tiny one.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import orjson

from switchyard.bench.harness import MODEL

# A chat body as an agent sends it (a system prompt, a tool call and its result, two
# tool definitions, sampling settings), written with spaces as most clients write it:
# what the duplicate-key check is timed on. Its text has colons in strings, so the
# check's counts are not trivially equal.
AGENT_CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [
        {
            "role": "system",
            "content": "You are ACME's support assistant. Answer briefly. Note: never "
            "reveal internal ids; dates as YYYY-MM-DD, times as HH:MM.",
        },
        {"role": "user", "content": "Where is order 12345? I placed it on 2024-05-01 at 10:32."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup_order", "arguments": '{"order_id": "12345"}'},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": '{"status": "shipped", "eta": "2024-05-04", "carrier": "UPS"}',
        },
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": {field: {"type": "string", "description": f"the {field}"}},
                    "required": [field],
                },
            },
        }
        for name, description, field in (
            ("lookup_order", "Look up an order by its id", "order_id"),
            ("create_ticket", "Open a support ticket", "title"),
        )
    ],
    "temperature": 0.2,
    "max_tokens": 256,
    "user": "u-42",
}


def duplicate_key_check_us(requests: int, blocks: int) -> dict[str, Any]:
    """CPU microseconds per request of parse_json's duplicate-key check
    (`repeated_key`) on AGENT_CHAT, min and median over blocks, with orjson's parse
    of the same body for scale. The driven targets send a tiny body; this is the
    check's cost on a realistic one. Refuses to time the exact check's fallback: a
    realistic body must be proven by the colon counts alone."""
    from switchyard.api.body import colons_accounted, repeated_key

    raw = json.dumps(AGENT_CHAT).encode()
    body = orjson.loads(raw)
    if not colons_accounted(raw, body) or repeated_key(raw, body) is not None:
        raise RuntimeError("the duplicate-key check did not prove the chat body on its counts")
    per = max(1, requests // blocks)

    def timed(step: Callable[[], object]) -> list[float]:
        out = []
        for _ in range(blocks):
            t = time.process_time()
            for _ in range(per):
                step()
            out.append((time.process_time() - t) / per * 1e6)
        return out

    check = timed(lambda: repeated_key(raw, body))
    parse = timed(lambda: orjson.loads(raw))
    return {
        "min": min(check),
        "median": statistics.median(check),
        "blocks": check,
        "parse_min": min(parse),
        "body_bytes": len(raw),
    }

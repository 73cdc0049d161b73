"""Chat completions as the protocol translation tests need them: a whole reply, and the
live stream of chunks an upstream sends for it, cut into pieces of a given size
(test_messages_codec.py, test_responses_codec.py), and a reply of tool calls only as
an upstream writes them (`calls_reply`)."""

from __future__ import annotations

import json
from typing import Any

Calls = list[tuple[str, str, dict[str, Any]]]  # (call id, name, arguments)


def chat_reply(text: str, calls: Calls, finish: str, usage: dict[str, int]) -> dict[str, Any]:
    """A whole chat completion with `text` and the tool `calls`."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, n, a in calls
        ]
    return {
        "id": "chatcmpl-abc",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": usage,
    }


def calls_reply(calls: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
    """A whole chat completion whose only answer is the tool `calls`, as an upstream
    writes them (its members as given: ids, indices and arguments are the test's)."""
    counts = usage or {"prompt_tokens": 9, "completion_tokens": 9}
    return {
        "id": "c1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None, "tool_calls": calls},
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {**counts, "total_tokens": sum(counts.values())},
    }


def _delta(delta: dict[str, Any], **head: Any) -> dict[str, Any]:
    return {**head, "choices": [{"index": 0, "delta": delta}]}


def live_chunks(
    text: str, calls: Calls, finish: str, usage: Any, piece: int
) -> list[dict[str, Any]]:
    """The chunks of the same reply streamed: the role first, the text in pieces of
    `piece` characters, each call's id and name then its arguments in pieces, the finish,
    and the usage chunk."""
    chunks = [_delta({"role": "assistant"}, id="chatcmpl-abc")]
    chunks += [_delta({"content": text[i : i + piece]}) for i in range(0, len(text), piece)]
    for k, (cid, name, args) in enumerate(calls):
        head = {
            "index": k,
            "id": cid,
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        chunks.append(_delta({"tool_calls": [head]}))
        encoded = json.dumps(args)
        for i in range(0, len(encoded), piece):
            part = {"index": k, "function": {"arguments": encoded[i : i + piece]}}
            chunks.append(_delta({"tool_calls": [part]}))
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    chunks.append({"choices": [], "usage": usage})
    return chunks

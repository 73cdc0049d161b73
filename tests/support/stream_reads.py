"""Reading a Responses or Messages stream as a client does, for the suites that script a
hostile upstream under them (test_hostile_s71f, test_streams_s72)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from support.gateways import Gateway

Events = list[tuple[str, dict[str, Any]]]


def sse_events(text: str) -> Events:
    """(event, data) of each SSE event of a stream's text (a `[DONE]` is no event)."""
    out = []
    for block in text.split("\n\n"):
        kind, data = "", ""
        for line in block.splitlines():
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:"):
                data += line[5:].strip()
        if data and data != "[DONE]":
            out.append((kind, json.loads(data)))
    return out


def streamed_bytes(gw: Gateway, key: str, path: str, body: dict[str, Any]) -> bytes:
    """A stream's bytes read to its end (or to the connection's end)."""
    text = b""
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with httpx.stream(
            "POST", gw.url + path, json={**body, "stream": True}, headers=headers, timeout=20
        ) as r:
            assert r.status_code == 200, r.read()[:400]
            for part in r.iter_bytes():
                text += part
    except httpx.RemoteProtocolError:  # the connection was cut mid-body: what came is read
        pass
    return text


def streamed(gw: Gateway, key: str, path: str, body: dict[str, Any]) -> Events:
    """The events of a stream read to its end (or to the connection's end)."""
    return sse_events(streamed_bytes(gw, key, path, body).decode())


def terminal(events: Events) -> dict[str, Any]:
    """The response object a Responses stream ended with (completed, incomplete or failed)."""
    ends = ("response.completed", "response.incomplete", "response.failed")
    last = [data for kind, data in events if kind in ends]
    assert len(last) == 1, f"no single terminal event: {[k for k, _ in events]}"
    return dict(last[0]["response"])


def stored(gw: Gateway, key: str, rid: str) -> dict[str, Any]:
    """A stored response as its tenant reads it back."""
    r = httpx.get(f"{gw.url}/v1/responses/{rid}", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text[:400]
    return dict(r.json())

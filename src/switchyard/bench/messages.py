"""`switchyard bench overhead --scenario realistic --scenario messages`: the Anthropic
Messages endpoint against the equivalent chat request, in the same run.

The `sy-messages` target is the realistic gateway itself (bench/realistic.py: a key
with limits under a tenant with limits and a daily budget, traces on), called on
`/v1/messages` with the Messages body that means the same request as the realistic
target's chat body (one user turn, the same output cap; `x-api-key` and
`anthropic-version` headers), streamed and not. Its added p50 over the direct call is
compared with `sy-realistic`'s: the target is a ratio of at most 1.2 (what decoding the
Messages shape and translating the reply and its events cost on top of a chat request).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from switchyard.bench.harness import MODEL, KeyedTarget, StartError, http, wrk_script

TARGET = "sy-messages"
BASELINE = "sy-realistic"  # bench/realistic.py's TARGET: the equivalent chat request
RATIO_MAX = 1.2
DESCRIPTION = (
    "sy-realistic's gateway and key on /v1/messages (x-api-key): the same request in the "
    "Anthropic Messages shape"
)


def messages_body(stream: bool, max_tokens: int) -> bytes:
    """The Messages request equivalent to harness.chat_body."""
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hi"}],
    }
    if stream:
        body["stream"] = True
    return json.dumps(body, separators=(",", ":")).encode()


def _script(body: bytes, key: str) -> str:
    return (
        wrk_script(body)
        + f'wrk.headers["x-api-key"] = "{key}"\n'
        + 'wrk.headers["anthropic-version"] = "2023-06-01"\n'
    )


def start_messages_target(
    workdir: Path, realistic_url: str, key: str, max_tokens: int
) -> KeyedTarget:
    """The realistic gateway's Messages URL and wrk scripts, once a request through it
    answers a message."""
    parts = urlsplit(realistic_url)
    url = urlunsplit((parts.scheme, parts.netloc, "/v1/messages", "", ""))
    scripts: dict[bool, Path] = {}
    for stream in (False, True):
        scripts[stream] = workdir / f"{TARGET}-{'stream' if stream else 'json'}.lua"
        scripts[stream].write_text(_script(messages_body(stream, max_tokens), key))
    status, body = http(
        "POST",
        url,
        messages_body(False, max_tokens),
        headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
    )
    if status != 200 or json.loads(body or b"{}").get("type") != "message":
        raise StartError(f"{TARGET}: POST /v1/messages answered {status}: {body[:300]!r}")
    return KeyedTarget(TARGET, url, scripts)


def ratios(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario: both targets' added p50 and the Messages/chat ratio with its verdict."""
    out = []
    for s in summary:
        t = s["targets"]
        if TARGET not in t or BASELINE not in t:
            continue
        direct = t["direct"]["p50_ms"]
        chat, msgs = t[BASELINE]["p50_ms"] - direct, t[TARGET]["p50_ms"] - direct
        ratio = msgs / chat if chat > 0 else None
        out.append(
            {
                "scenario": s["scenario"],
                "chat_added_p50_ms": chat,
                "messages_added_p50_ms": msgs,
                "ratio": ratio,
                "verdict": "PASS" if ratio is not None and ratio <= RATIO_MAX else "MISS",
            }
        )
    return out


def lines(summary: list[dict[str, Any]]) -> list[str]:
    """The report's lines for the Messages endpoint (none when it was not measured)."""
    rows = ratios(summary)
    if not rows:
        return []
    out = [f"Messages vs chat (added p50 {TARGET}/{BASELINE} <= {RATIO_MAX}):"]
    for r in rows:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
        out.append(
            f"  {r['scenario']:<16} chat +{r['chat_added_p50_ms']:.3f} ms, messages "
            f"+{r['messages_added_p50_ms']:.3f} ms, ratio {ratio}  [{r['verdict']}]"
        )
    return out


def record(result: dict[str, Any], summary: list[dict[str, Any]]) -> None:
    """The Messages workload and ratios in the results file."""
    tokens = result["workload"]["upstream_tokens"]
    result["workload"]["bodies"]["messages_non_stream"] = messages_body(False, tokens).decode()
    result["workload"]["bodies"]["messages_stream"] = messages_body(True, tokens).decode()
    result["workload"]["targets"][TARGET] = DESCRIPTION
    result["messages_ratios"] = ratios(summary)

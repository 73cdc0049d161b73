"""`switchyard bench overhead --scenario realistic protocols`: the Anthropic Messages and
OpenAI Responses endpoints against the equivalent chat request, in the same run.

Both targets are the realistic gateway itself (bench/realistic.py: a key with limits
under a tenant with limits and a daily budget, traces on), called with the same key on
another endpoint with the body that means the same request as the realistic target's
chat body (one user turn, the same output cap), streamed and not:

- `sy-messages`: `/v1/messages` (`x-api-key` and `anthropic-version` headers);
- `sy-responses`: `/v1/responses`, stored (`store` defaults to true, as OpenAI's does:
  each response is sealed and written to the store, as a user of the API gets it).

Each one's added p50 over the direct call is compared with `sy-realistic`'s: the target
is a ratio of at most 1.2 (what decoding the protocol's shape, translating the reply and
its events, and for Responses storing the response, cost on top of a chat request).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from switchyard.bench.harness import MODEL, KeyedTarget, StartError, http, wrk_script

MESSAGES = "sy-messages"
RESPONSES = "sy-responses"
TARGETS = (MESSAGES, RESPONSES)
BASELINE = "sy-realistic"  # bench/realistic.py's TARGET: the equivalent chat request
RATIO_MAX = 1.2
DESCRIPTIONS = {
    MESSAGES: "sy-realistic's gateway and key on /v1/messages (x-api-key): the same request "
    "in the Anthropic Messages shape",
    RESPONSES: "sy-realistic's gateway and key on /v1/responses: the same request in the "
    "OpenAI Responses shape, stored (the default)",
}


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


def responses_body(stream: bool, max_tokens: int) -> bytes:
    """The Responses request equivalent to harness.chat_body."""
    body: dict[str, Any] = {"model": MODEL, "input": "hi", "max_output_tokens": max_tokens}
    if stream:
        body["stream"] = True
    return json.dumps(body, separators=(",", ":")).encode()


# target -> (path, body, its headers given the key, what a JSON reply's "object"/"type" is)
_SPECS: dict[
    str, tuple[str, Callable[[bool, int], bytes], Callable[[str], dict[str, str]], str]
] = {
    MESSAGES: (
        "/v1/messages",
        messages_body,
        lambda key: {"x-api-key": key, "anthropic-version": "2023-06-01"},
        "message",
    ),
    RESPONSES: (
        "/v1/responses",
        responses_body,
        lambda key: {"Authorization": f"Bearer {key}"},
        "response",
    ),
}


def _script(body: bytes, headers: dict[str, str]) -> str:
    return wrk_script(body) + "".join(f'wrk.headers["{k}"] = "{v}"\n' for k, v in headers.items())


def start_protocol_targets(
    workdir: Path, realistic_url: str, key: str, max_tokens: int
) -> list[KeyedTarget]:
    """The realistic gateway's Messages and Responses URLs and wrk scripts, once a
    request through each answers in its protocol's shape."""
    parts = urlsplit(realistic_url)
    out = []
    for target, (path, body, headers_of, kind) in _SPECS.items():
        url = urlunsplit((parts.scheme, parts.netloc, path, "", ""))
        headers = headers_of(key)
        scripts: dict[bool, Path] = {}
        for stream in (False, True):
            scripts[stream] = workdir / f"{target}-{'stream' if stream else 'json'}.lua"
            scripts[stream].write_text(_script(body(stream, max_tokens), headers))
        status, got = http("POST", url, body(False, max_tokens), headers=headers)
        obj = json.loads(got or b"{}") if status == 200 else {}
        if obj.get("type", obj.get("object")) != kind:
            raise StartError(f"{target}: POST {path} answered {status}: {got[:300]!r}")
        out.append(KeyedTarget(target, url, scripts))
    return out


def ratios(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario and protocol target: both added p50s and the ratio with its verdict."""
    out = []
    for s in summary:
        t = s["targets"]
        if BASELINE not in t:
            continue
        direct = t["direct"]["p50_ms"]
        chat = t[BASELINE]["p50_ms"] - direct
        for target in TARGETS:
            if target not in t:
                continue
            added = t[target]["p50_ms"] - direct
            ratio = added / chat if chat > 0 else None
            out.append(
                {
                    "scenario": s["scenario"],
                    "target": target,
                    "chat_added_p50_ms": chat,
                    "added_p50_ms": added,
                    "ratio": ratio,
                    "verdict": "PASS" if ratio is not None and ratio <= RATIO_MAX else "MISS",
                }
            )
    return out


def lines(summary: list[dict[str, Any]]) -> list[str]:
    """The report's lines for the protocol endpoints (none when they were not measured)."""
    rows = ratios(summary)
    if not rows:
        return []
    out = [f"Protocols vs chat (added p50 target/{BASELINE} <= {RATIO_MAX}):"]
    for r in rows:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
        out.append(
            f"  {r['scenario']:<16} {r['target']:<13} chat +{r['chat_added_p50_ms']:.3f} ms, "
            f"this +{r['added_p50_ms']:.3f} ms, ratio {ratio}  [{r['verdict']}]"
        )
    return out


def record(result: dict[str, Any], summary: list[dict[str, Any]]) -> None:
    """The protocol workloads and ratios in the results file."""
    tokens = result["workload"]["upstream_tokens"]
    bodies = result["workload"]["bodies"]
    for name, fn in (("messages", messages_body), ("responses", responses_body)):
        bodies[f"{name}_non_stream"] = fn(False, tokens).decode()
        bodies[f"{name}_stream"] = fn(True, tokens).decode()
    result["workload"]["targets"].update(DESCRIPTIONS)
    result["protocol_ratios"] = ratios(summary)

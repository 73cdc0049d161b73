"""The PII data-flow rule, end to end (docs/operations/security.md).

Every PII type (and the credential forms of SECRET: `password=...`, a URL's
`user:password@`) goes through every field that can carry user text (message content,
content parts, names, tool-call arguments, `user`, a completion prompt and a list of
prompts), on both endpoints, in `observe_only` and `mask_upstream`, with the cache, the
idempotency store, traces and the OpenTelemetry file exporter on, and through an
upstream that quotes the request back (in its replies, and in 4xx and 5xx errors).
Then every file the gateway wrote — its SQLite files, read as bytes like `strings`
would, its log and the OTel file — must hold no raw value, and in `mask_upstream` the
bodies the upstream received must hold none either.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from support.gateways import start_gateway
from support.procs import Proc, free_port, wait_http
from support.upstreams import Scripted

# One value per type; a separate set per mode, so that what observe_only sends upstream
# (raw, by design) cannot be mistaken for a mask_upstream leak.
VALUES = {
    "observe": {
        "EMAIL": "jane.doe@example.com",
        "PHONE": "+1 (415) 555-2671",
        "CARD": "4111 1111 1111 1111",
        "IBAN": "DE89 3704 0044 0532 0130 00",
        "SSN": "123-45-6789",
        "KR_RRN": "900101-1234567",
        "IP": "192.168.1.10",
        "SECRET": "sk-proj-Zq8vL2mN4xR7tY1uW3eK9pA6sD0fG5hJ",
        "PASSWORD": "Hunter2Hunter2!",
        "USERINFO": "svcledger7:s3cretPass",
    },
    "masked": {
        "EMAIL": "kim_minsu@naver.com",
        "PHONE": "+44 20 7946 0958",
        "CARD": "5555555555554444",
        "IBAN": "GB82WEST12345698765432",
        "SSN": "078-05-1120",
        "KR_RRN": "850315-2123456",
        "IP": "10.20.30.40",
        "SECRET": "sk-ant-Hq3wE5rT7yU9iO1pA2sD4fG6hJ8kL0zX",
        "PASSWORD": "Tr0ub4dor&3x",
        "USERINFO": "alicebackup3:m4skedPw9",
    },
}
# Credentials are secrets by where they stand: after a key, in a URL's userinfo.
_CONTEXT = {"PASSWORD": "password={}", "USERINFO": "db https://{}@db.internal/app"}


def _needles(kind: str, raw: str) -> list[str]:
    """What must not be stored: a URL's user name and password each (the whole
    `user:password` is the secret; masking only the password as an e-mail kept the user)."""
    return raw.split(":") if kind == "USERINFO" else [raw]


def _text(values: dict[str, str]) -> str:
    phrases = (_CONTEXT.get(k, k.lower() + " {}").format(v) for k, v in values.items())
    return "Contact " + ", ".join(phrases) + "."


def _requests(model: str, values: dict[str, str]) -> list[tuple[str, dict[str, Any], str]]:
    """(path, body, what it exercises) for every text-bearing field."""
    text = _text(values)
    email = values["EMAIL"]
    chat = "/v1/chat/completions"
    return [
        (chat, {"messages": [{"role": "user", "content": text}]}, "content"),
        (
            chat,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]},
            "content parts",
        ),
        (
            chat,
            {"messages": [{"role": "user", "name": email, "content": "hello"}]},
            "name",
        ),
        (
            chat,
            {
                "messages": [
                    {"role": "user", "content": "look it up"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {
                                    "name": "lookup",
                                    "arguments": '{"who": "' + text + '"}',
                                },
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "call_1", "content": text},
                ]
            },
            "tool calls",
        ),
        (chat, {"messages": [{"role": "user", "content": "hi"}], "user": email}, "user"),
        ("/v1/completions", {"prompt": text}, "prompt"),
        ("/v1/completions", {"prompt": [text, "second " + text]}, "prompt list"),
    ]


@pytest.fixture(scope="module")
def world() -> Any:
    work = Path(tempfile.mkdtemp(prefix="switchyard-pii-"))
    record = work / "upstream-bodies.jsonl"
    port = free_port()
    upstream = Proc(
        [
            sys.executable,
            "-m",
            "switchyard.bench.scripted_upstream",
            "--port",
            str(port),
            "--record",
            str(record),
            "--echo",
        ],
        "scripted-echo",
    )
    wait_http(f"http://127.0.0.1:{port}/health", upstream)
    url = f"http://127.0.0.1:{port}/v1"
    db_dir = work / "db"
    db_dir.mkdir()
    otel = work / "spans.jsonl"
    config = {
        "models": [
            {
                "alias": alias,
                "engine": {"kind": "openai", "base_url": url},
                "resilience": {"retries": 0},
            }
            for alias in ("observe", "masked")
        ],
        "pii": {"mode": "observe_only", "models": {"masked": "mask_upstream"}},
        "cache": {"enabled": True, "semantic": False},
        "observe": {"otel": {"exporter": "file", "path": str(otel)}},
        "embeddings": {"enabled": False},
    }
    gw = start_gateway(config, db=str(db_dir / "switchyard.db"))
    yield gw, upstream, record, db_dir, otel, port
    gw.proc.stop()
    upstream.stop()


def test_no_raw_pii_at_rest_or_upstream_in_mask_mode(world: Any) -> None:
    gw, _upstream, record, db_dir, otel, port = world
    scripted = Scripted(port)
    sent = 0
    for model in ("observe", "masked"):
        for i, (path, body, what) in enumerate(_requests(model, VALUES[model])):
            payload = {"model": model, "max_tokens": 8, **body}
            # Once through the cache, once (not from the cache) into the idempotency store.
            keyed = {"Idempotency-Key": f"{model}-{i}", "cache-control": "no-store"}
            for extra in ({}, keyed):
                r = gw.post(path, json=payload, headers=extra)
                assert r.status_code == 200, (model, what, r.text)
                sent += 1
            # The upstream quotes the request in its errors too: a 4xx (whose words a
            # client sees) and a 5xx (whose words only the log and the trace see).
            for fault in ("echo:400", "echo:500"):
                scripted.fault(fault, count=1)
                r = gw.post(path, json=payload, headers={"cache-control": "no-store"})
                assert r.status_code in (400, 502), (model, what, fault, r.text)
                sent += 1
        # Replays come back with the raw values the client sent (restored).
        replay = gw.post(
            "/v1/chat/completions",
            json={"model": model, "max_tokens": 8, **_requests(model, VALUES[model])[0][1]},
            headers={"Idempotency-Key": f"{model}-0", "cache-control": "no-store"},
        )
        assert replay.headers.get("x-switchyard-idempotent-replay") == "true"
        assert VALUES[model]["EMAIL"] in replay.text
        assert VALUES[model]["PASSWORD"] in replay.text  # the placeholders map back
        assert VALUES[model]["USERINFO"] in replay.text
    # Everything the gateway wrote is on disk once it stops.
    gw.proc.stop()
    leaks = []
    files = [*db_dir.iterdir(), otel, Path(gw.proc.log.name)]
    assert any(f.name.endswith(".db") for f in files) and otel.exists()
    for f in files:
        data = f.read_bytes()
        for model, values in VALUES.items():
            for kind, raw in values.items():
                if any(n.encode() in data for n in _needles(kind, raw)):
                    leaks.append(f"{kind} ({model}) in {f.name}")
    assert not leaks, leaks
    # What the upstream received in mask_upstream: placeholders only.
    received = record.read_bytes()
    assert b"<EMAIL_1>" in received
    upstream_leaks = [
        k
        for k, raw in VALUES["masked"].items()
        if any(n.encode() in received for n in _needles(k, raw))
    ]
    assert not upstream_leaks, upstream_leaks
    assert VALUES["observe"]["EMAIL"].encode() in received  # observe_only: raw, by design
    assert sent > 40

"""The embedded default gateway, driven by the official `openai` client over loopback."""

from __future__ import annotations

import httpx
import numpy as np

from support.gateways import Gateway

MODEL = "smollm2-135m"
MSG = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def test_chat_non_streaming_answers_with_usage(default_gateway: Gateway) -> None:
    client = default_gateway.openai()
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MSG, max_tokens=16)
    r = raw.parse()
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content and r.choices[0].message.content.strip()
    assert r.usage is not None
    assert r.usage.prompt_tokens > 5
    assert 1 <= r.usage.completion_tokens <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert raw.headers["x-switchyard-model"] == MODEL
    assert raw.headers["x-switchyard-revision"] == "smollm2-135m-instruct-q4_1"
    assert raw.headers["x-switchyard-upstream"] == MODEL  # the deployment's name, no address
    assert raw.headers["x-request-id"].startswith("req_")
    assert "total;dur=" in raw.headers["server-timing"]


def test_chat_streaming_multiple_chunks_and_final_usage(default_gateway: Gateway) -> None:
    client = default_gateway.openai()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write two sentences about the sea."}],
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert len(content) > 1
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and chunks[-1].usage is not None
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens >= len(content) - 1
    assert chunks[-1].usage.prompt_tokens > 5


def test_streaming_without_include_usage_has_no_usage_chunk(default_gateway: Gateway) -> None:
    # The gateway asks the upstream for usage on its own behalf; the client must not see it.
    client = default_gateway.openai()
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, stream=True)
    )
    assert chunks, "no chunks"
    assert all(c.choices for c in chunks)
    assert all(getattr(c, "usage", None) is None for c in chunks)


def test_raw_sse_ends_with_done(default_gateway: Gateway) -> None:
    body = {"model": MODEL, "messages": MSG, "max_tokens": 4, "stream": True}
    with default_gateway.stream(body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_completions(default_gateway: Gateway) -> None:
    client = default_gateway.openai()
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8)
    assert r.object == "text_completion"
    assert r.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens >= 1


def test_models_lists_chat_and_embedding_models(default_gateway: Gateway) -> None:
    ids = {m.id for m in default_gateway.openai().models.list()}
    assert ids == {MODEL, "all-minilm-l6-v2"}


def test_embeddings_384_dims_and_deterministic(default_gateway: Gateway) -> None:
    client = default_gateway.openai()
    a = client.embeddings.create(model="all-minilm-l6-v2", input=["hello world", "a cat sat"])
    b = client.embeddings.create(model="all-minilm-l6-v2", input="hello world")
    assert len(a.data) == 2
    assert len(a.data[0].embedding) == 384
    assert a.usage.prompt_tokens > 0
    # The default client asks for base64; floats must round-trip exactly the same.
    np.testing.assert_allclose(a.data[0].embedding, b.data[0].embedding, rtol=0, atol=1e-6)
    assert abs(float(np.linalg.norm(a.data[0].embedding)) - 1.0) < 1e-3
    assert not np.allclose(a.data[0].embedding, a.data[1].embedding)
    # And the plain float encoding gives the same vector.
    r = default_gateway.post(
        "/v1/embeddings",
        json={"model": "all-minilm-l6-v2", "input": "hello world", "encoding_format": "float"},
        timeout=30,
    )
    assert r.status_code == 200
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], b.data[0].embedding, atol=1e-6)


def test_client_request_id_is_echoed_beside_the_gateways_own(default_gateway: Gateway) -> None:
    ids = set()
    for header in ("x-request-id", "x-client-request-id"):
        r = default_gateway.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": MSG, "max_tokens": 1},
            headers={header: "my-id.123"},
            timeout=60,
        )
        assert r.status_code == 200
        assert r.headers["x-client-request-id"] == "my-id.123"
        assert r.headers["x-request-id"].startswith("req_")
        ids.add(r.headers["x-request-id"])
    assert len(ids) == 2  # one client id twice: two requests, two ledger rows
    rows = [
        u
        for u in default_gateway.usage(limit=50)
        if u["client_request_id"] == "my-id.123" and u["request_id"] in ids
    ]
    assert len(rows) == 2
    bad = default_gateway.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": MSG, "max_tokens": 1},
        headers={"x-request-id": "no spaces <allowed>"},
        timeout=60,
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "x-request-id"
    assert bad.headers["x-request-id"].startswith("req_")


def test_health_and_readiness(default_gateway: Gateway) -> None:
    assert httpx.get(default_gateway.url + "/healthz").json() == {"status": "ok"}
    r = httpx.get(default_gateway.url + "/readyz")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ready"
    assert body["models"][MODEL]["state"] == "ready"
    assert body["models"][MODEL]["live"] is True
    assert body["models"]["all-minilm-l6-v2"]["ready"] is True

"""Request fields the official APIs refuse or treat as absent, and how a refusal of a
prompt past the model's context reaches each protocol's client. Over sockets against
one real gateway in front of the scripted upstream (`scripted.requests()` counts what
went upstream, `GET /control/last` shows the last body), with the official clients.

Defects these tests find (each fails on the code before this change):
- a Messages request's `system: []` or `system: ""` sent an empty `system` message
  upstream (api/messages_codec.py `to_chat`): the upstream saw a conversation other
  than the one policy checked. No system prompt now sends no system message; a system
  block whose text is empty stays a 400, as in the Messages API;
- a Responses `max_output_tokens` below 16 went upstream (api/responses_codec.py
  `check` allowed 1 and up); OpenAI's API answers 400 `invalid_request_error` naming
  `max_output_tokens` ("integer below minimum value ... >= 16");
- a Responses request past the model's context (the gateway's window check, or the
  engine's own refusal) was answered naming `messages`, the chat body's member, not
  the request's `input` (api/responses.py now names it; the Messages API's error body
  has no param and its words name `messages`);
- an upstream 401, 403, 404 or 422 whose message mentions the context was answered
  `context_length_exceeded` (engines/upstream.py `_context_refusal` read any 4xx); only
  400 and 413 are an engine's context refusal (llama-server's
  `exceed_context_size_error` is a 400, as vLLM's, OpenAI's and Anthropic's are).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from support.gateways import Gateway, cheap_config, start_gateway
from support.upstreams import Scripted

NO_STORE = {"Cache-Control": "no-store"}
TINY_WINDOW = 64  # tokens of the `tiny` model's context
LONG = "word " * 600  # well past TINY_WINDOW by any count
# What vLLM and OpenAI say when a prompt is past the context; the scripted upstream's
# `echo` fault quotes the request, so a prompt holding them is refused in those words.
CONTEXT_WORDS = "This model's maximum context length is 64 tokens."


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    tiny = {
        "alias": "tiny",
        "engine": {"kind": "openai", "base_url": scripted.url + "/v1"},
        "capabilities": {"context_window": TINY_WINDOW},
    }
    g = start_gateway(cheap_config(scripted, tiny))
    yield g
    g.proc.stop()


def _last(scripted: Scripted) -> dict[str, Any]:
    return dict(httpx.get(scripted.url + "/control/last", timeout=5).json()["body"])


def _anthropic(gw: Gateway, key: str | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key or gw.key, max_retries=0)


def _fault_once(scripted: Scripted, spec: str) -> None:
    scripted.fault(spec, count=1)


@pytest.fixture(autouse=True)
def _no_fault_left(scripted: Scripted) -> Iterator[None]:
    yield
    httpx.put(scripted.url + "/control/fault", json={"fault": None}, timeout=5)


# -- Messages: an absent system prompt sends no system message ---------------------------


@pytest.mark.parametrize("system", [[], ""], ids=["empty-list", "empty-string"])
def test_no_system_prompt_sends_no_system_message(
    gw: Gateway, scripted: Scripted, system: Any
) -> None:
    said = f"hello with system {system!r}"
    msg = _anthropic(gw).messages.create(
        model="cheap",
        max_tokens=16,
        system=system,
        messages=[{"role": "user", "content": said}],
        extra_headers=NO_STORE,
    )
    assert msg.type == "message" and msg.role == "assistant"
    sent = _last(scripted)["messages"]
    assert [m["role"] for m in sent] == ["user"], sent
    assert sent[0]["content"] == said


def test_a_system_prompt_of_blocks_is_one_system_message(gw: Gateway, scripted: Scripted) -> None:
    _anthropic(gw).messages.create(
        model="cheap",
        max_tokens=16,
        system=[{"type": "text", "text": "be brief"}, {"type": "text", "text": "be kind"}],
        messages=[{"role": "user", "content": "hello with blocks"}],
        extra_headers=NO_STORE,
    )
    sent = _last(scripted)["messages"]
    assert sent[0] == {"role": "system", "content": "be brief\n\nbe kind"}, sent
    assert [m["role"] for m in sent] == ["system", "user"]


def test_an_empty_system_block_is_refused(gw: Gateway, scripted: Scripted) -> None:
    """An empty text block is a 400 in the Messages API, in `system` as in a turn:
    nothing goes upstream."""
    before = scripted.requests()
    with pytest.raises(anthropic.BadRequestError) as info:
        _anthropic(gw).messages.create(
            model="cheap",
            max_tokens=16,
            system=[{"type": "text", "text": ""}],
            messages=[{"role": "user", "content": "hello"}],
            extra_headers=NO_STORE,
        )
    assert info.value.status_code == 400
    body = info.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "system[0].text" in body["error"]["message"], body
    assert scripted.requests() == before


# -- Responses: max_output_tokens of at least 16 -----------------------------------------


@pytest.mark.parametrize("cap", [15, 1, 0, -3])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_max_output_tokens_below_16_is_refused(
    gw: Gateway, scripted: Scripted, cap: int, stream: bool
) -> None:
    before = scripted.requests()
    with pytest.raises(openai.BadRequestError) as info:
        gw.openai().responses.create(
            model="cheap",
            input="a short answer please",
            max_output_tokens=cap,
            stream=stream,
            store=False,
            extra_headers=NO_STORE,
        )
    assert info.value.status_code == 400
    err = info.value.response.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "max_output_tokens", err
    assert "integer below minimum value" in err["message"], err
    assert ">= 16" in err["message"] and f"got {cap} instead" in err["message"], err
    assert scripted.requests() == before


def test_max_output_tokens_of_16_is_sent(gw: Gateway, scripted: Scripted) -> None:
    resp = gw.openai().responses.create(
        model="cheap", input="sixteen", max_output_tokens=16, store=False, extra_headers=NO_STORE
    )
    assert resp.status == "completed" and resp.max_output_tokens == 16
    assert _last(scripted)["max_tokens"] == 16


# -- a prompt past the context: the param each protocol names ----------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_window_check_names_responses_input(
    gw: Gateway, scripted: Scripted, stream: bool
) -> None:
    before = scripted.requests()
    with pytest.raises(openai.BadRequestError) as info:
        gw.openai().responses.create(
            model="tiny", input=LONG, stream=stream, store=False, extra_headers=NO_STORE
        )
    err = info.value.response.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "input", err
    assert scripted.requests() == before


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_engines_context_refusal_names_responses_input(
    gw: Gateway, scripted: Scripted, stream: bool
) -> None:
    _fault_once(scripted, "echo:400")
    with pytest.raises(openai.BadRequestError) as info:
        gw.openai().responses.create(
            model="cheap",
            input=f"{CONTEXT_WORDS} stream={stream}",
            stream=stream,
            store=False,
            extra_headers=NO_STORE,
        )
    err = info.value.response.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "input", err
    assert err["message"].endswith("shorten the input"), err
    assert "messages" not in err["message"], err


def test_a_background_responses_context_refusal_names_the_input(
    gw: Gateway, scripted: Scripted
) -> None:
    """Refused upstream after it was admitted: the stored response failed, and its
    error says what to shorten in the request's own words."""
    _fault_once(scripted, "echo:400")
    client = gw.openai()
    resp = client.responses.create(
        model="cheap", input=f"{CONTEXT_WORDS} background", background=True
    )
    for _ in range(200):
        resp = client.responses.retrieve(resp.id)
        if resp.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert resp.status == "failed", resp
    # A response's error has OpenAI's code for a refused prompt (its SDK's closed set);
    # the gateway's own code is the usage row's.
    assert resp.error is not None and resp.error.code == "invalid_prompt"
    assert resp.error.message.endswith("shorten the input"), resp.error


def test_chat_still_names_messages(gw: Gateway, scripted: Scripted) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        gw.openai().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": LONG}], extra_headers=NO_STORE
        )
    err = info.value.response.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages", err


@pytest.mark.parametrize("where", ["window", "engine"])
def test_messages_context_refusal_speaks_of_messages(
    gw: Gateway, scripted: Scripted, where: str
) -> None:
    if where == "engine":
        _fault_once(scripted, "echo:400")
    with pytest.raises(anthropic.BadRequestError) as info:
        _anthropic(gw).messages.create(
            model="tiny" if where == "window" else "cheap",
            max_tokens=16,
            messages=[{"role": "user", "content": LONG if where == "window" else CONTEXT_WORDS}],
            extra_headers=NO_STORE,
        )
    body = info.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    message = body["error"]["message"]
    assert "context length" in message or "context window" in message, body
    assert "input" not in message, body
    if where == "engine":
        assert message.endswith("shorten the messages"), body


# -- which upstream statuses are a context refusal ---------------------------------------


@pytest.mark.parametrize(
    ("status", "answered", "code", "param"),
    [
        *((s, s, "upstream_rejected", None) for s in (401, 403, 404, 409, 422)),
        *((s, 400, "context_length_exceeded", "messages") for s in (400, 413)),
    ],
)
def test_only_a_400_or_413_in_the_context_words_is_a_context_refusal(
    gw: Gateway, scripted: Scripted, status: int, answered: int, code: str, param: str | None
) -> None:
    """Another 4xx mentioning the context is its own failure (`upstream_rejected`), not
    `context_length_exceeded`; a 400 or 413 in those words is one."""
    tenant, key = gw.new_tenant("ctx")
    _fault_once(scripted, f"echo:{status}")
    r = gw.post(
        "/v1/chat/completions",
        key=key,
        json={"model": "cheap", "messages": [{"role": "user", "content": CONTEXT_WORDS}]},
        headers=NO_STORE,
    )
    assert r.status_code == answered, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    rows = gw.stored_rows(tenant)
    assert [row["error_code"] for row in rows] == [code], rows

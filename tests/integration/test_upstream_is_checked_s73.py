"""What goes upstream is exactly what the PII policy checked (s73): hostile requests
through one real gateway, over sockets, before the scripted upstream, which shows the
last body it received (`GET /control/last`). Models: `cheap` (OpenAI upstream) and
`claude` (Anthropic upstream) under `pii.mode: mask_upstream`, `blocked` under `block`,
`seen` (vision) under `mask_upstream`.

Defects these tests find (each failed before its fix, policy/pii.py):
- a tool call's `arguments` is JSON, read by its tool and by the model decoded: an
  address written `alice\\u0040example.com` inside it was scanned as written (no `@`),
  so it went upstream unmasked (chat, Responses `function_call`), was decoded to
  `alice@example.com` in the `tool_use` input an Anthropic upstream is sent, and passed
  `block`; a text is now read with its JSON escapes decoded (`_json_unescaped`);
- the media members (`image_url`, `input_audio`, `file_data`) were skipped wherever they
  stood: a tool schema's property named `image_url`, a `metadata` key `file_data`, an
  image's `detail` went upstream unmasked and passed `block`; now only a media part's
  payload (`image_url.url`, `input_audio.data`, `file.file_data`) is kept as sent;
- the detectors read ASCII only: an address with a zero-width space, a soft hyphen or
  a full-width commercial at (U+FF20), a card number in full-width digits, an address in Unicode tag
  characters (all read as the plain value by a model) went upstream unmasked and
  passed `block`; the detectors now read the text folded as a reader reads it
  (`_folded`), the placeholders covering the text's own characters, so the reply is
  restored to exactly what the client sent;
- a known top-level member spelt in other letters (`MODEL`, `Max_Tokens`, `max_tokens`
  with its k a Kelvin sign U+212A) was forwarded as an unknown member, and an upstream
  whose decoder matches names without case (Go's `encoding/json`: Ollama and many
  proxies) reads it as the member policy checked, the later one winning: another
  model than the one authorized, a cap past the one reserved; it is now refused 400
  naming it (policy/validate.py `case_variant`).

Probed and holding (no test kept): JSON escapes outside tool-call arguments (decoded
once by the gateway's parser), a BOM, lone surrogates, `NaN`, `1e999`, comments (400),
`1E2`, `-0` or a number past 64 bits as a cap (400), `stream_options: null`, only
`max_completion_tokens`, the `name`, `refusal`, `reasoning_content`, `prediction`,
`user`, a file's name, Responses `instructions`, Messages `system` blocks,
`tool_result` arrays and `metadata.user_id`, and no client header reaching an upstream.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.gateways import CHEAP_PRICE, Gateway, cheap_config, claude_model, start_gateway
from support.upstreams import Scripted

EMAIL = "alice@example.com"
# The arguments of a tool call are JSON text: this address is written in them with a
# JSON escape (the body carries it as `alice\\\\u0040example.com`).
ARGUMENTS = '{"to": "alice\\u0040example.com"}'
# A 2x2 PNG.
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGP8z8DAwMDAxMDAwMDAAAANHQEDasKb6QAAAABJRU5ErkJggg=="
TOOLS = [{"type": "function", "function": {"name": "send", "parameters": {"type": "object"}}}]


def _openai(alias: str, scripted: Scripted, **more: Any) -> dict[str, Any]:
    engine = {"kind": "openai", "base_url": scripted.url + "/v1"}
    return {"alias": alias, "engine": engine, "price": CHEAP_PRICE, **more}


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    claude = claude_model(scripted)
    seen = _openai("seen", scripted, capabilities={"supports_vision": True})
    config = cheap_config(
        scripted,
        claude,
        _openai("blocked", scripted),
        seen,
        pii={"mode": "mask_upstream", "models": {"blocked": "block"}},
    )
    g = start_gateway(config)
    yield g
    g.proc.stop()


def _post(gw: Gateway, body: dict[str, Any], path: str = "/v1/chat/completions") -> Any:
    """POST the body, never cached. Written as Python writes JSON, ASCII only: each
    other character is a `\\uXXXX` escape of the body (a pair for a tag character),
    which the gateway decodes."""
    return gw.post(path, json=body, headers={"Cache-Control": "no-store"})


def _last(scripted: Scripted) -> dict[str, Any]:
    return dict(httpx.get(scripted.url + "/control/last").json()["body"])


def _sent(scripted: Scripted, marker: str) -> dict[str, Any]:
    """The upstream's last body, which must be this test's request (its marker)."""
    body = _last(scripted)
    assert marker in json.dumps(body), body
    return body


def _refused_pii(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["code"] == "pii_detected", r.text[:300]


def _marker() -> str:
    return f"s73-{os.urandom(4).hex()}"


def _called_history(model: str, marker: str) -> dict[str, Any]:
    """A chat body whose history holds a call of `send` with `ARGUMENTS`, and its result."""
    call = {"id": "c1", "type": "function", "function": {"name": "send", "arguments": ARGUMENTS}}
    body = {
        "model": model,
        "max_tokens": 4,
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": marker},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sent"},
        ],
    }
    return body


# -- JSON escapes inside a tool call's arguments --------------------------------------


def test_an_escaped_address_in_tool_call_arguments_goes_upstream_masked(
    gw: Gateway, scripted: Scripted
) -> None:
    marker = _marker()
    r = _post(gw, _called_history("cheap", marker))
    assert r.status_code == 200, r.text[:300]
    body = _sent(scripted, marker)
    args = body["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(args) == {"to": "<EMAIL_1>"}, args
    assert "alice" not in json.dumps(body)


def test_an_anthropic_upstream_is_sent_the_masked_tool_use_input(
    gw: Gateway, scripted: Scripted
) -> None:
    """The Anthropic translation decodes the arguments into `tool_use.input`: before
    the fix the address arrived there in clear."""
    marker = _marker()
    r = _post(gw, _called_history("claude", marker))
    assert r.status_code == 200, r.text[:300]
    body = _sent(scripted, marker)
    tool_use = body["messages"][1]["content"][0]
    assert tool_use["type"] == "tool_use" and tool_use["input"] == {"to": "<EMAIL_1>"}, body


def test_a_responses_function_call_with_an_escaped_address_goes_upstream_masked(
    gw: Gateway, scripted: Scripted
) -> None:
    marker = _marker()
    body = {
        "model": "cheap",
        "store": False,
        "tools": [{"type": "function", "name": "send", "parameters": {"type": "object"}}],
        "input": [
            {"type": "message", "role": "user", "content": marker},
            {"type": "function_call", "call_id": "c1", "name": "send", "arguments": ARGUMENTS},
            {"type": "function_call_output", "call_id": "c1", "output": "sent"},
        ],
    }
    r = _post(gw, body, "/v1/responses")
    assert r.status_code == 200, r.text[:300]
    sent = _sent(scripted, marker)
    args = sent["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(args) == {"to": "<EMAIL_1>"}, args


def test_block_refuses_an_escaped_address_in_tool_call_arguments(gw: Gateway) -> None:
    _refused_pii(_post(gw, _called_history("blocked", _marker())))


# -- members named like media that are not a media part's payload --------------------


def test_a_tool_schema_property_named_image_url_is_read(gw: Gateway, scripted: Scripted) -> None:
    marker = _marker()
    schema = {"type": "object", "properties": {"image_url": {"description": f"mail {EMAIL}"}}}
    tools = [{"type": "function", "function": {"name": "send", "parameters": schema}}]
    body = {"model": "cheap", "max_tokens": 4, "tools": tools}
    r = _post(gw, {**body, "messages": [{"role": "user", "content": marker}]})
    assert r.status_code == 200, r.text[:300]
    sent = _sent(scripted, marker)
    prop = sent["tools"][0]["function"]["parameters"]["properties"]["image_url"]
    assert prop == {"description": "mail <EMAIL_1>"}, sent


def test_a_metadata_key_named_file_data_is_read(gw: Gateway, scripted: Scripted) -> None:
    marker = _marker()
    body = {"model": "cheap", "max_tokens": 4, "metadata": {"file_data": EMAIL}}
    r = _post(gw, {**body, "messages": [{"role": "user", "content": marker}]})
    assert r.status_code == 200, r.text[:300]
    assert _sent(scripted, marker)["metadata"] == {"file_data": "<EMAIL_1>"}


def test_block_refuses_an_address_under_a_media_name_in_metadata(gw: Gateway) -> None:
    body = {"model": "blocked", "max_tokens": 4, "metadata": {"image_url": EMAIL}}
    _refused_pii(_post(gw, {**body, "messages": [{"role": "user", "content": _marker()}]}))


def test_an_images_detail_is_read(gw: Gateway, scripted: Scripted) -> None:
    marker = _marker()
    url = "data:image/png;base64," + PNG  # a media payload: never read
    part = {"type": "image_url", "image_url": {"url": url, "detail": EMAIL}}
    content = [{"type": "text", "text": marker}, part]
    r = _post(
        gw, {"model": "seen", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    )
    assert r.status_code == 200, r.text[:300]
    image = _sent(scripted, marker)["messages"][0]["content"][1]["image_url"]
    assert image["detail"] == "<EMAIL_1>" and image["url"].startswith("data:image/"), image


# -- text a reader reads through: invisible characters, compatibility forms ------------


@pytest.mark.parametrize(
    "written",
    [
        "alice\u200b@example.com",  # zero-width space
        "alice\u00ad@example.com",  # soft hyphen
        "alice\uff20example.com",  # full-width commercial at
        "".join(chr(0xE0000 + ord(c)) for c in EMAIL),  # Unicode tag characters
    ],
    ids=["zero-width", "soft-hyphen", "full-width-at", "tags"],
)
def test_an_address_a_reader_reads_through_goes_upstream_masked_and_comes_back_as_sent(
    gw: Gateway, content: Scripted, written: str
) -> None:
    marker = _marker()
    content.content("Reply to <EMAIL_1> soon.")
    text = f"{marker} write to {written}"
    r = _post(
        gw, {"model": "cheap", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
    )
    assert r.status_code == 200, r.text[:300]
    assert _sent(content, marker)["messages"][0]["content"] == f"{marker} write to <EMAIL_1>"
    assert r.json()["choices"][0]["message"]["content"] == f"Reply to {written} soon."


def test_a_card_in_full_width_digits_goes_upstream_masked(gw: Gateway, scripted: Scripted) -> None:
    marker = _marker()
    card = "\uff14\uff11\uff11\uff11 1111 1111 1111"  # 4111 1111 1111 1111, Luhn-valid
    text = f"{marker} card {card}"
    r = _post(
        gw, {"model": "cheap", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
    )
    assert r.status_code == 200, r.text[:300]
    assert _sent(scripted, marker)["messages"][0]["content"] == f"{marker} card <CARD_1>"


def test_block_refuses_an_address_with_a_zero_width_space(gw: Gateway) -> None:
    text = f"{_marker()} alice\u200b@example.com"
    _refused_pii(
        _post(
            gw,
            {"model": "blocked", "max_tokens": 4, "messages": [{"role": "user", "content": text}]},
        )
    )


# -- member names an upstream matches without case -------------------------------------


@pytest.mark.parametrize(
    "name, value, known",
    [
        ("MODEL", "some-other-model", "model"),
        ("Max_Tokens", 100000, "max_tokens"),
        ("max_to\u212aens", 100000, "max_tokens"),  # a Kelvin sign: Go folds it to k
    ],
    ids=["model", "cap", "kelvin-sign"],
)
def test_a_known_member_spelt_in_other_letters_is_refused_by_name(
    gw: Gateway, scripted: Scripted, name: str, value: Any, known: str
) -> None:
    """Forwarded as an unknown member, it would be read by a Go upstream as the
    member policy checked (the later of the two wins): another model, a lifted cap."""
    before = scripted.requests()
    body = {"model": "cheap", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = _post(gw, {**body, name: value})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error", err
    assert err["param"] == name.encode("ascii", "backslashreplace").decode(), err
    assert f"'{known}'" in err["message"], err
    assert scripted.requests() == before  # nothing went upstream

"""Hostile use of stored and background Responses (`/v1/responses`): reads, query
parameters and failures, over sockets against one real gateway in front of the scripted
upstream, with the official `openai` SDK where a client would use it and raw httpx for
what no SDK sends.

Defects these tests find (each failed before its fix):
- a background response that failed stored the gateway's own code as its `error.code`
  (`upstream_error`, `upstream_rejected`, `upstream_rate_limited`: api/responses.py
  `_run`), none of the codes OpenAI's API gives a response (the SDK's
  `ResponseError.code` is a closed set);
- `GET /v1/responses/{id}?stream=true` (the SDK's `responses.retrieve(id, stream=True)`)
  was answered with the JSON object, which the SDK read as an empty event stream: no
  error, no events;
- `GET /v1/responses/{id}/input_items` ignored any `include` (the SDK sends
  `include[]=...`), a silent drop where `POST` refuses what it cannot honour;
- its `limit` was read with Python's `int`: `+5`, `1_0` and ` 5` were taken as limits;
- a 404 repeated the id of the path as it came, control characters, line breaks and
  bidi overrides included.
"""

from __future__ import annotations

import time
import typing
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses.response_error import ResponseError

from support.gateways import Gateway, cheap_config, start_gateway
from support.upstreams import Scripted

OPENAI_CODES = frozenset(typing.get_args(ResponseError.model_fields["code"].annotation))


@pytest.fixture(scope="module")
def gw(scripted: Scripted) -> Iterator[Gateway]:
    """One gateway for the module: no retries and no breaker to open, so each scripted
    fault reaches the response it is meant for."""
    config = cheap_config(scripted, responses={"max_background_per_tenant": 4})
    config["models"][0]["resilience"] = {"retries": 0, "breaker": {"failures": 1000}}
    g = start_gateway(config)
    yield g
    g.proc.stop()


@pytest.fixture(scope="module")
def stored(gw: Gateway) -> str:
    """A stored response with one input item."""
    r = gw.post("/v1/responses", json={"model": "cheap", "input": "hello there"})
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def _get(gw: Gateway, path: str) -> httpx.Response:
    return httpx.get(gw.url + path, headers=gw.auth, timeout=30)


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return dict(r.json()["error"])


def test_retrieve_with_stream_is_refused_naming_stream(gw: Gateway, stored: str) -> None:
    client = gw.openai()
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.retrieve(stored, stream=True)
    assert raised.value.status_code == 400
    err = _error(raised.value.response, 400)
    assert (err["param"], err["type"]) == ("stream", "invalid_request_error")
    # Without it (or with it false) the object is answered as before.
    assert client.responses.retrieve(stored).id == stored
    assert _get(gw, f"/v1/responses/{stored}?stream=false").json()["id"] == stored


def test_input_items_refuse_an_include_they_cannot_honour(gw: Gateway, stored: str) -> None:
    client = gw.openai()
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.input_items.list(stored, include=["file_search_call.results"])
    assert _error(raised.value.response, 400)["param"] == "include"
    err = _error(_get(gw, f"/v1/responses/{stored}/input_items?include=anything"), 400)
    assert err["param"] == "include"
    err = _error(_get(gw, f"/v1/responses/{stored}?include[]=reasoning.encrypted_content"), 400)
    assert err["param"] == "include"
    # The one value they honour (the items hold their image URLs) is answered.
    page = client.responses.input_items.list(stored, include=["message.input_image.image_url"])
    assert [item.type for item in page.data] == ["message"]


@pytest.mark.parametrize("limit", ["1_0", "%2B5", "%205", "5%20"])
def test_input_items_limit_is_digits(gw: Gateway, stored: str, limit: str) -> None:
    err = _error(_get(gw, f"/v1/responses/{stored}/input_items?limit={limit}"), 400)
    assert (err["param"], err["code"]) == ("limit", "invalid_request")
    ok = _get(gw, f"/v1/responses/{stored}/input_items?limit=10")
    assert ok.status_code == 200 and len(ok.json()["data"]) == 1


@pytest.mark.parametrize("odd", ["%E2%80%AEgnp.exe", "resp_1%0AERROR%20forged", "%00%1b[31m"])
def test_a_404_does_not_repeat_control_characters(gw: Gateway, odd: str) -> None:
    for path in (f"/v1/responses/{odd}", f"/v1/responses/{odd}/input_items"):
        err = _error(_get(gw, path), 404)
        assert (err["code"], err["param"]) == ("not_found", "response_id")
        assert err["message"] == "no response with that id"
    # An id of an id's characters is still named.
    err = _error(_get(gw, "/v1/responses/resp_0123"), 404)
    assert err["message"] == "no response with id 'resp_0123'"


def _settled(gw: Gateway, rid: str) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    while True:
        body = dict(_get(gw, f"/v1/responses/{rid}").json())
        if body["status"] not in ("queued", "in_progress") or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


# Last: an upstream 429 is the last fault this module's upstream gives.
@pytest.mark.parametrize(
    ("fault", "code"),
    [
        ("status:400", "invalid_prompt"),
        ("status:500", "server_error"),
        ("close", "server_error"),
        ("status:429", "rate_limit_exceeded"),
    ],
)
def test_a_failed_background_response_has_an_openai_error_code(
    gw: Gateway, scripted: Scripted, fault: str, code: str
) -> None:
    scripted.fault(fault, count=1)
    client = gw.openai()
    created = client.responses.create(model="cheap", input="say hi", background=True)
    assert created.status in ("queued", "in_progress")
    body = _settled(gw, created.id)
    assert body["status"] == "failed", body
    assert body["error"]["code"] == code and code in OPENAI_CODES
    assert body["error"]["message"]
    got = client.responses.retrieve(created.id)  # as the SDK reads it
    assert got.error is not None and got.error.code == code

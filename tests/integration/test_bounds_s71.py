"""Fields the chat and completions codecs forward but did not bound, over sockets against
one real gateway in front of the scripted upstream (its model `cheap`).

Each bad shape is answered 400 in the OpenAI error body naming the member (`param`),
before anything reaches the upstream; each valid shape of the official API goes
upstream exactly as sent (the scripted upstream's `GET /control/last`).

Defects these tests found (each failed on the code before policy/validate.py bounded it):
- a `stop` string of any length, or an empty one, was sent upstream (only the count
  was bounded);
- `input_audio` and `file` content parts were forwarded whatever they held (no `data`,
  data that is not base64, an unknown format, a file with neither data nor id, ids and
  filenames of any length);
- `modalities`, `audio`, `prediction` and `web_search_options` were forwarded knowingly
  (CHAT_FIELDS) and never checked.
"""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest

from support.gateways import Gateway
from support.upstreams import Scripted

AUDIO = "UklGRiQAAABXQVZFZm10IBAAAAAB"  # base64 of a WAV header's first bytes
LONG = "x" * 1000  # the longest stop string
WHERE = "messages[0].content[1]"


def _ask() -> str:
    return f"say something {os.urandom(4).hex()}"  # unique: never an exact cache hit


def _chat(**fields: Any) -> dict[str, Any]:
    return {
        "model": "cheap",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": _ask()}],
    } | fields


def _with_part(part: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": _ask()}, part]
    return _chat(messages=[{"role": "user", "content": content}])


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": "cheap", "max_tokens": 4, "prompt": _ask(), **fields}


def _refused(gw: Gateway, scripted: Scripted, path: str, body: dict[str, Any], param: str) -> None:
    before = scripted.requests()
    r = gw.post(path, json=body)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_request", err
    assert err["param"] == param, err
    assert isinstance(err["message"], str) and param.split("[")[0].split(".")[0] in err["message"]
    assert scripted.requests() == before  # nothing reached the upstream


def _passed(gw: Gateway, scripted: Scripted, path: str, body: dict[str, Any]) -> dict[str, Any]:
    before = scripted.requests()
    r = gw.post(path, json=body)
    assert r.status_code == 200, r.text[:300]
    assert scripted.requests() == before + 1
    sent = httpx.get(scripted.url + "/control/last", timeout=5).json()["body"]
    return dict(sent)


# -- stop -----------------------------------------------------------------------------------

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.mark.parametrize(
    ("path", "stop", "param"),
    [
        (CHAT, "", "stop"),
        (CHAT, ["END", ""], "stop[1]"),
        (CHAT, LONG + "x", "stop"),
        (CHAT, [LONG + "x"], "stop[0]"),
        (CHAT, ["a", "b", "c", "d", "e"], "stop"),
        (CHAT, ["a", 5], "stop"),
        (COMPLETIONS, "", "stop"),
        (COMPLETIONS, ["ok", LONG + "x"], "stop[1]"),
    ],
    ids=[
        "chat-empty", "chat-empty-in-list", "chat-long", "chat-long-in-list", "chat-five",
        "chat-not-string", "completion-empty", "completion-long-in-list",
    ],
)  # fmt: skip
def test_a_stop_string_empty_or_too_long_is_a_400(
    gw: Gateway, scripted: Scripted, path: str, stop: Any, param: str
) -> None:
    body = _chat(stop=stop) if path == CHAT else _completion(stop=stop)
    _refused(gw, scripted, path, body, param)


@pytest.mark.parametrize(
    ("path", "stop"),
    [
        (CHAT, LONG),
        (CHAT, ["\n", "END", "x", LONG]),
        (COMPLETIONS, "\n\n"),
        (COMPLETIONS, [LONG]),
    ],
    ids=["chat-longest", "chat-four", "completion-newlines", "completion-longest"],
)
def test_a_stop_string_within_bounds_goes_upstream_unchanged(
    gw: Gateway, scripted: Scripted, path: str, stop: Any
) -> None:
    body = _chat(stop=stop) if path == CHAT else _completion(stop=stop)
    assert _passed(gw, scripted, path, body)["stop"] == stop


def test_a_messages_stop_sequence_of_the_longest_length_still_passes(
    gw: Gateway, scripted: Scripted
) -> None:
    """The Messages codec turns `stop_sequences` into chat's `stop` and checks it with
    validate_chat: its own bound (1,000 characters) agrees with chat's."""
    body = {
        "model": "cheap",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": _ask()}],
        "stop_sequences": [LONG, "END"],
    }
    before = scripted.requests()
    r = gw.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["type"] == "message"
    assert scripted.requests() == before + 1
    sent = httpx.get(scripted.url + "/control/last", timeout=5).json()["body"]
    assert sent["stop"] == [LONG, "END"]


# -- input_audio and file parts -----------------------------------------------------------------


def _audio(**audio: Any) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": audio}


def _file(**file: Any) -> dict[str, Any]:
    return {"type": "file", "file": file}


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "input_audio"}, f"{WHERE}.input_audio"),
        ({"type": "input_audio", "input_audio": "UklG"}, f"{WHERE}.input_audio"),
        (_audio(format="wav"), f"{WHERE}.input_audio.data"),
        (_audio(data=123, format="wav"), f"{WHERE}.input_audio.data"),
        (_audio(data="", format="wav"), f"{WHERE}.input_audio.data"),
        (_audio(data="not base64!", format="wav"), f"{WHERE}.input_audio.data"),
        (_audio(data="UklGR", format="wav"), f"{WHERE}.input_audio.data"),
        (_audio(data="data:audio/wav;base64," + AUDIO, format="wav"), f"{WHERE}.input_audio.data"),
        (_audio(data=AUDIO), f"{WHERE}.input_audio.format"),
        (_audio(data=AUDIO, format="ogg"), f"{WHERE}.input_audio.format"),
        ({"type": "file"}, f"{WHERE}.file"),
        ({"type": "file", "file": "file-abc"}, f"{WHERE}.file"),
        (_file(), f"{WHERE}.file"),
        (_file(filename="report.pdf"), f"{WHERE}.file"),
        (_file(file_id=5), f"{WHERE}.file.file_id"),
        (_file(file_id=""), f"{WHERE}.file.file_id"),
        (_file(file_id="f" * 129), f"{WHERE}.file.file_id"),
        (_file(file_id="file-1\r\nx"), f"{WHERE}.file.file_id"),
        (_file(file_data=""), f"{WHERE}.file.file_data"),
        (_file(file_data=["JVBERi0x"]), f"{WHERE}.file.file_data"),
        (_file(file_id="file-1", filename="r" * 257), f"{WHERE}.file.filename"),
        (_file(file_id="file-1", filename="a\nb.pdf"), f"{WHERE}.file.filename"),
        (_file(file_id="file-1", filename=None), f"{WHERE}.file.filename"),
    ],
    ids=[
        "audio-missing", "audio-not-object", "audio-no-data", "audio-data-number",
        "audio-data-empty", "audio-data-not-base64", "audio-data-bad-length",
        "audio-data-url", "audio-no-format", "audio-format-ogg", "file-missing",
        "file-not-object", "file-empty", "file-filename-only", "file-id-number",
        "file-id-empty", "file-id-long", "file-id-control", "file-data-empty",
        "file-data-list", "filename-long", "filename-control", "filename-null",
    ],
)  # fmt: skip
def test_a_malformed_audio_or_file_part_is_a_400(
    gw: Gateway, scripted: Scripted, part: Any, param: str
) -> None:
    _refused(gw, scripted, CHAT, _with_part(part), param)


@pytest.mark.parametrize(
    "part",
    [
        _audio(data=AUDIO, format="wav"),
        _audio(data="SUQzBAAAAAAAI1RTU0U=", format="mp3"),
        _file(file_id="file-q3-report"),
        _file(file_data="data:application/pdf;base64,JVBERi0xLjQK", filename="q3 report.pdf"),
        _file(file_id="file-q3-report", filename="q3.pdf")
        | {"prompt_cache_breakpoint": {"mode": "explicit"}},
    ],
    ids=["audio-wav", "audio-mp3", "file-id", "file-data-and-name", "file-extra-member"],
)
def test_a_valid_audio_or_file_part_goes_upstream_unchanged(
    gw: Gateway, scripted: Scripted, part: dict[str, Any]
) -> None:
    body = _with_part(part)
    sent = _passed(gw, scripted, CHAT, body)
    assert sent["messages"][0]["content"][1] == part


# -- modalities, audio, prediction, web_search_options ------------------------------------------

_NEAR = {"type": "approximate", "approximate": {"city": "Lyon"}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"modalities": "text"}, "modalities"),
        ({"modalities": ["text", "video"]}, "modalities"),
        ({"modalities": ["text", "text"]}, "modalities"),
        ({"modalities": ["text", "audio", "text"]}, "modalities"),
        ({"modalities": ["text", "audio"]}, "audio"),
        ({"audio": "alloy"}, "audio"),
        ({"audio": {"voice": "alloy"}}, "audio.format"),
        ({"audio": {"voice": "alloy", "format": "ogg"}}, "audio.format"),
        ({"audio": {"format": "wav"}}, "audio.voice"),
        ({"audio": {"voice": "v" * 65, "format": "wav"}}, "audio.voice"),
        ({"audio": {"voice": "alloy\n", "format": "wav"}}, "audio.voice"),
        ({"audio": {"voice": {"id": 5}, "format": "wav"}}, "audio.voice"),
        ({"prediction": "the text"}, "prediction"),
        ({"prediction": {"type": "code", "content": "x"}}, "prediction.type"),
        ({"prediction": {"type": "content"}}, "prediction.content"),
        ({"prediction": {"type": "content", "content": 5}}, "prediction.content"),
        ({"prediction": {"type": "content", "content": []}}, "prediction.content"),
        (
            {"prediction": {"type": "content", "content": [{"type": "image_url"}]}},
            "prediction.content[0]",
        ),
        ({"web_search_options": "low"}, "web_search_options"),
        ({"web_search_options": {"search_context_size": "huge"}}, "web_search_options.search_context_size"),
        ({"web_search_options": {"depth": 3}}, "web_search_options.depth"),
        ({"web_search_options": {"user_location": "Lyon"}}, "web_search_options.user_location"),
        (
            {"web_search_options": {"user_location": {**_NEAR, "type": "exact"}}},
            "web_search_options.user_location.type",
        ),
        (
            {"web_search_options": {"user_location": {"type": "approximate"}}},
            "web_search_options.user_location.approximate",
        ),
        (
            {"web_search_options": {"user_location": {"type": "approximate", "approximate": {"city": "c" * 129}}}},
            "web_search_options.user_location.approximate.city",
        ),
        (
            {"web_search_options": {"user_location": {"type": "approximate", "approximate": {"country": "USA"}}}},
            "web_search_options.user_location.approximate.country",
        ),
        (
            {"web_search_options": {"user_location": {"type": "approximate", "approximate": {"street": "1 Rue"}}}},
            "web_search_options.user_location.approximate.street",
        ),
        (
            {"web_search_options": {"user_location": {"type": "approximate", "approximate": {"timezone": 1}}}},
            "web_search_options.user_location.approximate.timezone",
        ),
    ],
    ids=[
        "modalities-string", "modalities-video", "modalities-duplicate", "modalities-three",
        "modalities-audio-without-audio", "audio-string", "audio-no-format", "audio-format-ogg",
        "audio-no-voice", "audio-voice-long", "audio-voice-control", "audio-voice-id-number",
        "prediction-string", "prediction-type", "prediction-no-content",
        "prediction-content-number", "prediction-content-empty", "prediction-content-image",
        "search-string", "search-size", "search-unknown-member", "search-location-string",
        "search-location-type", "search-location-no-approximate", "search-city-long",
        "search-country", "search-unknown-location-member", "search-timezone-number",
    ],
)  # fmt: skip
def test_a_malformed_chat_output_option_is_a_400(
    gw: Gateway, scripted: Scripted, fields: dict[str, Any], param: str
) -> None:
    _refused(gw, scripted, CHAT, _chat(**fields), param)


@pytest.mark.parametrize(
    "fields",
    [
        {"modalities": ["text"]},
        {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
        {"modalities": ["audio"], "audio": {"voice": {"id": "voice_1234"}, "format": "pcm16"}},
        {"prediction": {"type": "content", "content": "def f():\n    return 1\n"}},
        {"prediction": {"type": "content", "content": [{"type": "text", "text": "x = 1"}]}},
        {"web_search_options": {}},
        {"web_search_options": {"search_context_size": "high", "user_location": None}},
        {
            "web_search_options": {
                "user_location": {
                    "type": "approximate",
                    "approximate": {
                        "city": "San Francisco",
                        "country": "US",
                        "region": "California",
                        "timezone": "America/Los_Angeles",
                    },
                }
            }
        },
    ],
    ids=[
        "modalities-text", "audio-voice", "audio-custom-voice", "prediction-string",
        "prediction-parts", "search-empty", "search-size", "search-location",
    ],
)  # fmt: skip
def test_a_valid_chat_output_option_goes_upstream_unchanged(
    gw: Gateway, scripted: Scripted, fields: dict[str, Any]
) -> None:
    sent = _passed(gw, scripted, CHAT, _chat(**fields))
    assert {k: sent.get(k) for k in fields} == fields

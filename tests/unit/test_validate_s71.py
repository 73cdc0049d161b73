"""policy/validate.py's bounds on chat's audio parts and output options, where the
integration tests (tests/integration/test_bounds_s71.py) would need many requests:
base64's edges, and which endpoint knows chat's own options under
`validation.unknown_fields: reject`."""

from __future__ import annotations

from typing import Any

import pytest

from switchyard.errors import InvalidRequest
from switchyard.policy.validate import validate_chat, validate_completion


def _audio_chat(data: str) -> dict[str, Any]:
    part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    return {"model": "m", "messages": [{"role": "user", "content": [part]}]}


@pytest.mark.parametrize("data", ["AAAA", "AAA=", "AA==", "ab+/Zz09", "UklGRiQAAABXQVZF" * 64])
def test_padded_standard_base64_is_audio_data(data: str) -> None:
    assert validate_chat(_audio_chat(data)) == "m"


@pytest.mark.parametrize(
    "data", ["A", "AAA", "A===", "AA=A", "AAAA\n", "AA AA", "ab-_", "AAAA====", "ÀAAA"]
)
def test_anything_else_is_not(data: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        validate_chat(_audio_chat(data))
    assert exc.value.param == "messages[0].content[0].input_audio.data"


OPTIONS = {
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "mp3"},
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {"search_context_size": "low"},
}


def test_chat_knows_its_output_options_where_unknown_fields_are_refused() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **OPTIONS}
    assert validate_chat(body, "reject") == "m"


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_a_completion_does_not(name: str) -> None:
    """Chat's output options are no member of a completion: under `reject` each is an
    unknown field there, not a chat-shaped check."""
    with pytest.raises(InvalidRequest) as exc:
        validate_completion({"model": "m", "prompt": "p", name: OPTIONS[name]}, "reject")
    assert exc.value.param == name
    assert "unknown field" in exc.value.message

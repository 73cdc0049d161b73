"""engines/upstream.py `_upstream_error`: an engine's refusal of a prompt past its
context is `context_length_exceeded` naming the prompt's member, in the gateway's own
words; a member llama-server refuses by name is the error's `param`."""

from __future__ import annotations

import orjson
import pytest

from switchyard.engines.upstream import _upstream_error
from switchyard.errors import ContextLengthExceeded, UpstreamStatusError

LLAMA = {
    "error": {
        "code": 400,
        "message": "request (1350 tokens) exceeds the available context size (1024 tokens), "
        "try increasing it",
        "type": "exceed_context_size_error",
        "n_prompt_tokens": 1350,
        "n_ctx": 1024,
    }
}
VLLM = {
    "error": {
        "message": "This model's maximum context length is 4096 tokens. However, you "
        "requested 5000 tokens.",
        "type": "BadRequestError",
        "code": 400,
    }
}
ANTHROPIC = {"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long: 300000 tokens > 200000 maximum"}}  # fmt: skip


@pytest.mark.parametrize(
    ("body", "path", "param"),
    [
        (LLAMA, "/chat/completions", "messages"),
        (LLAMA, "/completions", "prompt"),
        (VLLM, "/chat/completions", "messages"),
        (ANTHROPIC, "/messages", "messages"),
    ],
)
def test_a_context_refusal_names_the_prompt(body: dict, path: str, param: str) -> None:
    err = _upstream_error(400, orjson.dumps(body), "engine", None, path)
    assert isinstance(err, ContextLengthExceeded)
    assert err.status == 400 and err.code == "context_length_exceeded"
    assert err.param == param
    assert "try increasing" not in err.message and "BadRequestError" not in err.message


def test_llama_servers_counts_are_told_only_as_integers() -> None:
    err = _upstream_error(400, orjson.dumps(LLAMA), "engine", None, "/chat/completions")
    assert "1024 tokens" in err.message and "1350 tokens" in err.message
    forged = {"error": {**LLAMA["error"], "n_ctx": "<script>", "n_prompt_tokens": 1e300}}
    err = _upstream_error(400, orjson.dumps(forged), "engine", None, "/chat/completions")
    assert "<script>" not in err.message and "1e+300" not in err.message


def test_a_member_llama_server_refuses_is_the_param_and_bounded() -> None:
    body = {"error": {"code": 400, "message": "Field 'n': Value must be between 1 <= value <= 2"}}
    err = _upstream_error(400, orjson.dumps(body), "engine", None, "/chat/completions")
    assert isinstance(err, UpstreamStatusError) and err.param == "n"
    long = {"error": {"message": "bad", "param": "p" * 5000}}
    err = _upstream_error(400, orjson.dumps(long), "engine", None, "/chat/completions")
    assert err.param == "p" * 64


def test_a_server_error_is_no_context_refusal() -> None:
    err = _upstream_error(500, orjson.dumps(VLLM), "engine", None, "/chat/completions")
    assert not isinstance(err, ContextLengthExceeded)
    assert "maximum context length" not in err.message

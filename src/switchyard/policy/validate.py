"""Request validation: the shape checks done before any costly work.

Hand-written rather than a pydantic model on purpose: it runs on every request, it
names the offending field the way OpenAI does (`messages[2].role`), and it leaves
every field it does not know untouched so the upstream sees the client's request.
"""

from __future__ import annotations

from typing import Any

from switchyard.errors import InvalidRequest

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise InvalidRequest(
            "you must provide a model parameter", param="model", code="missing_required_parameter"
        )
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string", param="model")
    return model


def _optional(body: dict[str, Any], name: str, types: tuple[type, ...], what: str) -> None:
    v = body.get(name)
    if v is None:
        return
    if isinstance(v, bool) and bool not in types:
        raise InvalidRequest(f"'{name}' must be {what}", param=name)
    if not isinstance(v, types):
        raise InvalidRequest(f"'{name}' must be {what}", param=name)


_INT = ((int,), "an integer")
_NUM = ((int, float), "a number")
# Typed optional fields: name -> (accepted types, what the error calls them).
_TYPED: dict[str, tuple[tuple[type, ...], str]] = {
    "stream": ((bool,), "a boolean"),
    "max_tokens": _INT,
    "max_completion_tokens": _INT,
    "n": _INT,
    "seed": _INT,
    "top_k": _INT,
    "temperature": _NUM,
    "top_p": _NUM,
    "presence_penalty": _NUM,
    "frequency_penalty": _NUM,
}
_AT_LEAST_1 = frozenset({"max_tokens", "max_completion_tokens", "n"})
_RANGES = {"temperature": (0, 2), "top_p": (0, 1)}


def _stop(body: dict[str, Any], stop: Any) -> None:
    if not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise InvalidRequest("'stop' must be a string or a list of strings", param="stop")


def _stream_options(body: dict[str, Any], so: Any) -> None:
    if not isinstance(so, dict):
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")
    if not body.get("stream"):
        raise InvalidRequest(
            "'stream_options' is only allowed when 'stream' is true", param="stream_options"
        )
    iu = so.get("include_usage")
    if iu is not None and not isinstance(iu, bool):
        raise InvalidRequest(
            "'stream_options.include_usage' must be a boolean",
            param="stream_options.include_usage",
        )


def _logit_bias(body: dict[str, Any], lb: Any) -> None:
    if not isinstance(lb, dict):
        raise InvalidRequest("'logit_bias' must be an object", param="logit_bias")


_OTHER: dict[str, Any] = {
    "stop": _stop,
    "stream_options": _stream_options,
    "logit_bias": _logit_bias,
}


def _sampling(body: dict[str, Any]) -> None:
    # Walk the fields the client sent (a handful) rather than every field we know; a
    # field sent as null counts as not sent.
    for name, v in body.items():
        if v is None:
            continue
        spec = _TYPED.get(name)
        if spec is not None:
            _optional(body, name, spec[0], spec[1])
            if name in _AT_LEAST_1 and v < 1:
                raise InvalidRequest(f"'{name}' must be at least 1", param=name)
            bounds = _RANGES.get(name)
            if bounds is not None and not bounds[0] <= v <= bounds[1]:
                raise InvalidRequest(
                    f"'{name}' must be between {bounds[0]} and {bounds[1]}", param=name
                )
            continue
        check = _OTHER.get(name)
        if check is not None:
            check(body, v)


def validate_chat(body: Any) -> str:
    """Check a chat completion request; return its model name."""
    body = _require_object(body)
    model = _model(body)
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest(
            "you must provide a 'messages' parameter",
            param="messages",
            code="missing_required_parameter",
        )
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"'messages[{i}]' must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in _ROLES:
            raise InvalidRequest(
                f"'messages[{i}].role' must be one of {sorted(_ROLES)}", param=f"messages[{i}].role"
            )
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidRequest(
                f"'messages[{i}].content' must be a string or an array of parts",
                param=f"messages[{i}].content",
            )
        if content is None and role in ("system", "developer", "user"):
            raise InvalidRequest(
                f"'messages[{i}].content' is required for role {role!r}",
                param=f"messages[{i}].content",
            )
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequest("'tools' must be an array", param="tools")
    _sampling(body)
    return model


def validate_completion(body: Any) -> str:
    body = _require_object(body)
    model = _model(body)
    prompt = body.get("prompt")
    if prompt is None:
        raise InvalidRequest(
            "you must provide a 'prompt' parameter",
            param="prompt",
            code="missing_required_parameter",
        )
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
        raise InvalidRequest("'prompt' must be a string or a non-empty array", param="prompt")
    _sampling(body)
    return model


def validate_embeddings(body: Any, max_inputs: int) -> tuple[str, list[str]]:
    """Check an embeddings request; return the model and the list of input texts."""
    body = _require_object(body)
    model = _model(body)
    inp = body.get("input")
    if inp is None:
        raise InvalidRequest(
            "you must provide an 'input' parameter",
            param="input",
            code="missing_required_parameter",
        )
    texts = [inp] if isinstance(inp, str) else inp
    if not isinstance(texts, list) or not texts:
        raise InvalidRequest(
            "'input' must be a string or a non-empty array of strings", param="input"
        )
    if not all(isinstance(t, str) for t in texts):
        raise InvalidRequest(
            "'input' must contain strings (token arrays are not supported)", param="input"
        )
    if len(texts) > max_inputs:
        raise InvalidRequest(f"'input' may hold at most {max_inputs} items", param="input")
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ("float", "base64"):
        raise InvalidRequest(
            "'encoding_format' must be 'float' or 'base64'", param="encoding_format"
        )
    return model, texts

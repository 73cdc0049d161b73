"""Chat-completions request -> Anthropic Messages request, for engines/anthropic.py.

Pure (no I/O): which chat fields become Messages fields (`TRANSLATED`), which are
dropped as meaningless there (`DROPPED`), which are refused unless at their default
(`DEFAULT_ONLY`), and the translation of the conversation, its images, tool calls,
tool results, tools and tool choice. What cannot be translated is refused with a 400
(InvalidRequest) naming the field, before anything is sent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson

from switchyard.errors import InvalidRequest
from switchyard.request import may_hold_wide_integer, wide_integer

# The Messages API requires max_tokens; the gateway always sends its cap (policy/cost.py),
# so this applies only to a payload that reached here without one.
DEFAULT_MAX_TOKENS = 4096

# Chat fields that become Messages fields.
TRANSLATED = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "temperature",
        "top_p",
        "top_k",
        "user",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "stream",
        "stream_options",
    }
)
# Chat fields with no meaning in the Messages API, dropped: sampling knobs it lacks
# (seed, penalties, token-id biases of another tokenizer) and OpenAI's own storage,
# tiering and caching hints.
DROPPED = frozenset(
    {
        "seed",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "service_tier",
        "store",
        "metadata",
        "prediction",
        "reasoning_effort",
        "verbosity",
        "prompt_cache_key",
        "safety_identifier",
    }
)


# Chat fields refused unless at their default: the Messages API cannot do what they ask.
DEFAULT_ONLY = frozenset(
    {
        "n",
        "logprobs",
        "top_logprobs",
        "response_format",
        "functions",
        "function_call",
        "audio",
        "modalities",
        "return_token_ids",
    }
)


def _default_only(name: str, value: Any) -> bool:
    """Whether a chat field that only has its default meaning here is at its default."""
    if value is None:
        return True
    if name == "n":
        return value == 1
    if name in ("logprobs", "return_token_ids"):
        return value is False
    if name == "top_logprobs":
        return value == 0
    if name == "response_format":
        return isinstance(value, dict) and value.get("type") == "text"
    if name == "modalities":
        return value == ["text"]
    if name in ("functions", "function_call"):
        return value == []
    return False  # audio


def _refuse(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(
        f"{message} (this model's upstream speaks Anthropic's Messages API)", param=param
    )


# -- chat request -> Messages request ---------------------------------------------------


def chat_to_messages(
    obj: Mapping[str, Any], default_max_tokens: int = DEFAULT_MAX_TOKENS
) -> dict[str, Any]:
    """A chat-completions request as a Messages request. Raises InvalidRequest (400)
    naming what cannot be translated."""
    for name, value in obj.items():
        if name in TRANSLATED or name in DROPPED:
            continue
        if name in DEFAULT_ONLY:
            if not _default_only(name, value):
                raise _refuse(f"'{name}' cannot be honoured", param=name)
            continue
        raise _refuse(f"'{name}' has no equivalent in the Messages API", param=name)
    system, turns = _conversation(obj.get("messages"))
    out: dict[str, Any] = {
        "model": obj.get("model"),
        "max_tokens": _max_tokens(obj, default_max_tokens),
        "messages": turns,
    }
    if system:
        out["system"] = system
    stop = obj.get("stop")
    if isinstance(stop, str):
        out["stop_sequences"] = [stop]
    elif isinstance(stop, list) and stop:
        out["stop_sequences"] = stop
    for name in ("temperature", "top_p", "top_k"):
        if obj.get(name) is not None:
            out[name] = obj[name]
    user = obj.get("user")
    if isinstance(user, str) and user:
        out["metadata"] = {"user_id": user}
    tools = obj.get("tools")
    if tools:
        out["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(_list(tools, "tools"))]
        choice = _tool_choice(obj.get("tool_choice"), obj.get("parallel_tool_calls"))
        if choice is not None:
            out["tool_choice"] = choice
    if obj.get("stream") is True:
        out["stream"] = True
    return out


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise _refuse(f"'{where}' must be a list", param=where)
    return value


def _max_tokens(obj: Mapping[str, Any], default: int) -> int:
    """The smaller of the two output caps that is set: the tighter bound asked for."""
    caps = [
        v
        for v in (obj.get("max_tokens"), obj.get("max_completion_tokens"))
        if isinstance(v, int) and not isinstance(v, bool)
    ]
    return min(caps) if caps else default


def _conversation(messages: Any) -> tuple[str | list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """(system, turns): system and developer messages become the top-level `system`;
    the rest become alternating user and assistant turns, `role: tool` messages user
    turns of `tool_result` blocks, and consecutive turns of one role one turn."""
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    for i, m in enumerate(_list(messages, "messages")):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _refuse(f"'{where}' must be an object", param=where)
        role = m.get("role")
        if role in ("system", "developer"):
            system += _text_blocks(m.get("content"), where)
            continue
        if role == "user":
            blocks = _user_blocks(m.get("content"), where)
        elif role == "assistant":
            blocks = _assistant_blocks(m, where)
        elif role == "tool":
            blocks, role = [_tool_result(m, where)], "user"
        else:
            raise _refuse(f"'{where}.role' {role!r} cannot be translated", param=f"{where}.role")
        if not blocks:
            continue  # the Messages API refuses empty turns
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    for turn in turns:
        turn["content"] = _compact(turn["content"])
    return (_compact(system) if system else None), turns


def _compact(blocks: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A lone plain text block as a string, as a person would write it."""
    if len(blocks) == 1 and blocks[0].keys() == {"type", "text"}:
        return str(blocks[0]["text"])
    return blocks


def _text_block(part: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    text = part.get("text")
    if not isinstance(text, str):
        raise _refuse(f"'{where}.text' must be a string", param=f"{where}.text")
    if not text:
        return None
    block: dict[str, Any] = {"type": "text", "text": text}
    if isinstance(part.get("cache_control"), dict):  # prompt caching, as Anthropic takes it
        block["cache_control"] = part["cache_control"]
    return block


def _text_blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """Text-only content (system, developer, assistant): a string or text parts."""
    if content is None or content == "":
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    out = []
    for j, part in enumerate(_list(content, f"{where}.content")):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "refusal"):
            raise _refuse(f"'{at}' of type {kind!r} cannot be translated here", param=at)
        block = _text_block({"text": part.get("refusal")} if kind == "refusal" else part, at)
        if block is not None:
            out.append(block)
    return out


def _user_blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """A user message's content: text and image parts."""
    if not isinstance(content, list):
        return _text_blocks(content, where)
    out = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            block = _text_block(part, at)
            if block is not None:
                out.append(block)
        elif kind == "image_url":
            out.append(_image(part.get("image_url"), at))
        else:
            raise _refuse(f"'{at}' of type {kind!r} cannot be translated", param=at)
    return out


def _image(image: Any, where: str) -> dict[str, Any]:
    """An image part: a data: URL becomes a base64 source, an http(s) URL a url source."""
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str):
        raise _refuse(f"'{where}.image_url.url' must be a string", param=f"{where}.image_url")
    if url.startswith("data:"):
        head, sep, data = url[5:].partition(",")
        media_type, _, encoding = head.partition(";")
        if not sep or encoding != "base64" or not media_type:
            raise _refuse(
                f"'{where}.image_url' must be a base64 data URL (data:<type>;base64,...)",
                param=f"{where}.image_url",
            )
        source = {"type": "base64", "media_type": media_type, "data": data}
    elif url.startswith(("http://", "https://")):
        source = {"type": "url", "url": url}
    else:
        raise _refuse(f"'{where}.image_url' must be a data: or http(s) URL", param=where)
    return {"type": "image", "source": source}


def _assistant_blocks(m: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """An assistant message: its text, then a `tool_use` block per tool call."""
    out = _text_blocks(m.get("content"), where)
    calls = m.get("tool_calls")
    for j, call in enumerate(_list(calls, f"{where}.tool_calls") if calls else []):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise _refuse(f"'{at}' is not a function call", param=at)
        args = fn.get("arguments")
        try:
            parsed = orjson.loads(args) if isinstance(args, str) and args.strip() else {}
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise _refuse(
                f"'{at}.function.arguments' must be a JSON object (it becomes the tool "
                "call's input)",
                param=f"{at}.function.arguments",
            )
        _exact_integers(args, parsed, f"{at}.function.arguments")
        out.append(
            {"type": "tool_use", "id": call.get("id"), "name": fn.get("name"), "input": parsed}
        )
    return out


def _exact_integers(args: Any, parsed: dict[str, Any], where: str) -> None:
    """Refuse arguments holding an integer no 64-bit integer holds: decoded into the
    `tool_use` input (orjson reads it as a float), it would reach the upstream rounded,
    where an OpenAI upstream is sent the arguments' text as written (request.py)."""
    if not parsed or not may_hold_wide_integer(orjson.dumps(parsed)):
        return
    wide = wide_integer(args)
    if wide is not None:
        inner, literal = wide
        shown = json.dumps(inner[:100])[1:-1]  # ASCII, no control character
        raise _refuse(
            f"'{where}' holds the integer {literal[:40]} (at '{shown}'), past 64 bits (no "
            "64-bit integer holds it): it would reach the tool_use input rounded; send it as a "
            "string",
            param=where,
        )


def _tool_result(m: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A `role: tool` message as a `tool_result` block for its call."""
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": m.get("tool_call_id")}
    content = m.get("content")
    if isinstance(content, list):
        parts = _user_blocks(content, where)
        if parts:
            block["content"] = parts
    elif isinstance(content, str) and content:
        block["content"] = content
    elif content not in (None, ""):
        raise _refuse(f"'{where}.content' must be a string or parts", param=f"{where}.content")
    return block


def _tool(t: Any, where: str) -> dict[str, Any]:
    fn = t.get("function") if isinstance(t, dict) else None
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
        raise _refuse(f"'{where}' must be a function tool", param=where)
    params = fn.get("parameters")
    out: dict[str, Any] = {"name": fn.get("name")}
    if fn.get("description"):
        out["description"] = fn["description"]
    out["input_schema"] = params if params else {"type": "object", "properties": {}}
    return out


def _tool_choice(choice: Any, parallel: Any) -> dict[str, Any] | None:
    """`tool_choice` (auto, none, required, a named function) and `parallel_tool_calls:
    false` as Anthropic's tool_choice."""
    out: dict[str, Any]
    if choice is None:
        if parallel is not False:
            return None
        out = {"type": "auto"}
    elif choice == "auto":
        out = {"type": "auto"}
    elif choice == "none":
        return {"type": "none"}
    elif choice == "required":
        out = {"type": "any"}
    elif (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        out = {"type": "tool", "name": choice["function"]["name"]}
    else:
        raise _refuse("'tool_choice' cannot be translated", param="tool_choice")
    if parallel is False:
        out["disable_parallel_tool_use"] = True
    return out

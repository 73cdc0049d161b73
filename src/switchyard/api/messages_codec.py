"""The Anthropic Messages protocol's request codec: `POST /v1/messages` (and its
`count_tokens`) decoded once into the internal request model (`Generation`, chat
messages), so every stage runs on it as it does on a chat completion.

The shape checks name the offending member (`messages[2].content[0].source`) and
refuse what the gateway cannot honour — an unsupported field or block type gets a 400
naming it, never a silent drop. Translation:

| Messages | chat completions |
|---|---|
| `system` (a string or text blocks) | a first `system` message (none for `""` or `[]`) |
| `text` and `image` blocks (base64 or URL) | text and `image_url` parts |
| an assistant turn's `tool_use` blocks | its `tool_calls` (`input` as JSON arguments) |
| a user turn's `tool_result` blocks (first in it) | `tool` messages, then the turn's other content |
| `tools` (custom), `tool_choice` auto/any/tool/none | function `tools`, auto/required/{function}/none |
| `max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k` | the same caps and sampling |
| `metadata.user_id` | `user` |
| `stream` | `stream` with `include_usage` (the stream's last event carries usage) |

`cache_control` on blocks and tools is a prompt-caching hint: accepted in the Messages
API's shape (`{"type": "ephemeral"}`, optional `ttl` "5m" or "1h") and not forwarded
(engines reuse a prompt's prefix on their own). `thinking` is accepted only as
`{"type": "disabled"}`.

The request as a whole is checked as the Messages API checks it: tool blocks pair up
(each `tool_result` answers a `tool_use` of the assistant turn just before, each
`tool_use` is answered in the turn just after, no id twice: `ToolPairs`, one rule
with the Responses codec), a turn's `tool_result` blocks come first in it, and tool
blocks need `tools`; a text block's `citations` is a list of citation objects; tool
names are distinct (policy/validate.py `tools_array`), each `input_schema` an object
schema; a text block is never empty, a stop sequence never whitespace alone.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from switchyard.api.checks import ToolPairs, bad, no_extras, number, string
from switchyard.api.checks import past_int64 as _past_int64
from switchyard.api.codecs import CHAT_TYPED
from switchyard.errors import InvalidRequest, MissingRequiredParameter
from switchyard.policy.validate import (
    CONTROL,
    MAX_STOP,
    MAX_STOP_CHARS,
    answerable_choice,
    tools_array,
    validate_chat,
)
from switchyard.request import Generation, from_object

# The top-level members the gateway honours; any other is refused by name.
FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "metadata",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "thinking",
    }
)
COUNT_FIELDS = FIELDS - {"max_tokens", "stream", "stop_sequences", "temperature", "top_p", "top_k"}
IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
_TOOL_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}")
_ID = re.compile(r"[A-Za-z0-9_\-]{1,128}")
MAX_USER_ID = 256
INT32_MAX = 2**31 - 1


CACHE_HINT = frozenset({"cache_control"})  # a prompt-caching hint: accepted, not forwarded
CACHE_TTLS = frozenset({"5m", "1h"})


def _cache_control(value: Any, where: str) -> None:
    """A `cache_control` hint is Anthropic's shape or refused: `{"type": "ephemeral"}`
    with an optional `ttl` of "5m" or "1h" (null: no hint). It is not forwarded, but a
    client testing its request here must not learn a shape the Messages API refuses."""
    if value is None:
        return
    if (
        not isinstance(value, dict)
        or value.get("type") != "ephemeral"
        or not value.keys() <= {"type", "ttl"}
        or not isinstance(value.get("ttl", "5m"), str)  # a list: unhashable
        or value.get("ttl", "5m") not in CACHE_TTLS
    ):
        raise bad(
            f'\'{where}.cache_control\' must be {{"type": "ephemeral"}}, with an optional '
            "'ttl' of '5m' or '1h'",
            f"{where}.cache_control",
        )


def _no_extras_cc(block: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    no_extras(block, allowed, where, CACHE_HINT)
    if "cache_control" in block:
        _cache_control(block["cache_control"], where)


_TEXT_KEYS = frozenset({"type", "text", "citations"})
_IMAGE_KEYS = frozenset({"type", "source"})
_TOOL_USE_KEYS = frozenset({"type", "id", "name", "input"})
_TOOL_RESULT_KEYS = frozenset({"type", "tool_use_id", "content", "is_error"})


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    _no_extras_cc(block, _IMAGE_KEYS, where)
    src = block.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "base64":
        assert isinstance(src, dict)
        media = src.get("media_type")
        data = src.get("data")
        if not isinstance(media, str) or media not in IMAGE_TYPES:  # a list: unhashable
            raise bad(
                f"'{where}.source.media_type' must be one of {sorted(IMAGE_TYPES)}",
                f"{where}.source.media_type",
            )
        if not isinstance(data, str) or not data:
            raise bad(f"'{where}.source.data' must be a base64 string", f"{where}.source.data")
        url = f"data:{media};base64,{data}"
    elif kind == "url":
        assert isinstance(src, dict)
        link = src.get("url")
        if not isinstance(link, str) or not link.startswith(("http://", "https://")):
            raise bad(f"'{where}.source.url' must be an http(s) URL", f"{where}.source.url")
        url = link
    else:
        raise bad(
            f"'{where}.source' must be an object of type 'base64' or 'url'", f"{where}.source"
        )
    return {"type": "image_url", "image_url": {"url": url}}


# A citation's members by its type (the Messages API's `TextCitationParam`), each
# required: a string, an integer, or a string or null.
_IN_DOCUMENT = {"document_index": "int", "document_title": "str?"}
_CITED = {"type": "str", "cited_text": "str"}
_CITATIONS: dict[str, dict[str, str]] = {
    kind: {**_CITED, **members}
    for kind, members in {
        "char_location": {"start_char_index": "int", "end_char_index": "int", **_IN_DOCUMENT},
        "page_location": {"start_page_number": "int", "end_page_number": "int", **_IN_DOCUMENT},
        "content_block_location": {
            "start_block_index": "int",
            "end_block_index": "int",
            **_IN_DOCUMENT,
        },
        "web_search_result_location": {"encrypted_index": "str", "title": "str?", "url": "str"},
        "search_result_location": {
            "search_result_index": "int",
            "source": "str",
            "start_block_index": "int",
            "end_block_index": "int",
            "title": "str?",
        },
    }.items()
}
MAX_CITATIONS = 100  # citations of one text block


def _member_ok(v: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= INT32_MAX
    return isinstance(v, str) or (kind == "str?" and v is None)


def _citations(cites: Any, where: str) -> None:
    """A text block's `citations`: null, or a list of the Messages API's citation
    objects (accepted, not forwarded: they point into documents the model read)."""
    if cites is None:
        return
    where = f"{where}.citations"
    if not isinstance(cites, list) or len(cites) > MAX_CITATIONS:
        raise bad(f"'{where}' must be a list of at most {MAX_CITATIONS} citations", where)
    for k, cite in enumerate(cites):
        cw = f"{where}[{k}]"
        kind = cite.get("type") if isinstance(cite, dict) else None
        members = _CITATIONS.get(kind) if isinstance(kind, str) else None
        if members is None:
            raise bad(f"'{cw}' must be a citation object of type {sorted(_CITATIONS)}", cw)
        assert isinstance(cite, dict)
        no_extras(cite, frozenset(members), cw)
        for name, want in members.items():
            if not _member_ok(cite.get(name, ...), want):
                shape = {"int": "an integer", "str": "a string", "str?": "a string or null"}
                raise bad(f"'{cw}.{name}' must be {shape[want]}", f"{cw}.{name}")


def _text_block(block: dict[str, Any], where: str) -> dict[str, Any]:
    _no_extras_cc(block, _TEXT_KEYS, where)
    text = string(block.get("text"), f"{where}.text")
    if not text:  # the Messages API's rule; a reply with nothing to say has no block
        raise bad(f"'{where}.text': text content blocks must be non-empty", f"{where}.text")
    if "citations" in block:
        _citations(block["citations"], where)
    return {"type": "text", "text": text}


def _block_type(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise bad(f"'{where}' must be a content block object with a 'type'", where)
    return kind


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    _no_extras_cc(block, _TOOL_RESULT_KEYS, where)
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not _ID.fullmatch(call_id):
        raise bad(f"'{where}.tool_use_id' must be a tool_use id", f"{where}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            pw = f"{where}.content[{k}]"
            if _block_type(part, pw) != "text":
                raise bad(f"'{pw}': a tool_result holds text blocks only here", pw)
            texts.append(_text_block(part, pw)["text"])
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise bad(f"'{where}.content' must be a string or text blocks", f"{where}.content")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise bad(f"'{where}.is_error' must be a boolean", f"{where}.is_error")
    if is_error:
        content = "[tool error] " + content
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    _no_extras_cc(block, _TOOL_USE_KEYS, where)
    call_id, name, args = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not _ID.fullmatch(call_id):
        raise bad(f"'{where}.id' must be 1-128 of A-Z a-z 0-9 _ -", f"{where}.id")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise bad(f"'{where}.name' must be 1-64 of A-Z a-z 0-9 _ -", f"{where}.name")
    if not isinstance(args, dict):
        raise bad(f"'{where}.input' must be an object", f"{where}.input")
    if _past_int64(args):
        raise bad(
            f"'{where}.input' holds an integer past 64 bits, which would go upstream "
            "rounded; send it as a string",
            f"{where}.input",
        )
    try:
        arguments = orjson.dumps(args).decode()
    except TypeError:  # not from a parsed body (orjson reads big integers as floats)
        raise bad(f"'{where}.input' is not JSON that can be sent on", f"{where}.input") from None
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Chat content: one text as a string, else the parts."""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return parts


def _turn(i: int, m: Any) -> list[dict[str, Any]]:
    """One Messages turn as chat messages."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"'{where}' must be an object", where)
    for k in m:
        if k not in ("role", "content"):
            raise bad(f"'{where}.{k[:64]}' is not supported", f"{where}.{k[:64]}")
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise bad(f"'{where}.role' must be 'user' or 'assistant'", f"{where}.role")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list) or not content:
        raise bad(
            f"'{where}.content' must be a string or a non-empty array of blocks",
            f"{where}.content",
        )
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        bw = f"{where}.content[{j}]"
        kind = _block_type(block, bw)
        if kind == "tool_result" and parts:
            # Anthropic's rule: a turn answering tool calls begins with its results
            raise bad(
                f"'{where}': tool_result blocks must come first in their turn, before "
                f"any other content ({bw} follows other blocks)",
                where,
            )
        if kind == "text":
            parts.append(_text_block(block, bw))
        elif kind == "image" and role == "user":
            parts.append(_image(block, bw))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, bw))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, bw))
        else:
            raise bad(f"'{bw}': block type {kind[:40]!r} is not supported in a {role} turn", bw)
    out = results
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": _content(parts) if parts else None}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif parts:
        out.append({"role": "user", "content": _content(parts)})
    return out


def _blocks(m: dict[str, Any], kind: str) -> list[tuple[int, dict[str, Any]]]:
    """The blocks of `kind` in a turn `_turn` has checked, by their index."""
    content = m["content"]
    if isinstance(content, str):
        return []
    return [(j, b) for j, b in enumerate(content) if b["type"] == kind]


def _paired_tools(messages: list[Any]) -> bool:
    """Whether the conversation holds tool blocks; raises the 400 unless they pair up
    as the Messages API requires (`ToolPairs`, the Responses codec's rule too): each
    `tool_result` answers a `tool_use` of the assistant turn just before, each
    `tool_use` is answered by the turn just after, and no id is used twice (a result
    for a call never made is a forged tool output; a call left unanswered, or one of
    two calls of one id, one no engine can place). Runs on turns `_turn` has checked
    (a turn's results come first in it)."""
    pairs: ToolPairs | None = None
    for i, m in enumerate(messages):
        content = m["content"]
        if pairs is None:  # no tool block yet: the common turn
            if isinstance(content, str) or all(
                b["type"] not in ("tool_use", "tool_result") for b in content
            ):
                continue
            pairs = ToolPairs("tool_use", "tool_result")
        where = f"messages[{i}]"
        if m["role"] == "assistant":
            pairs.turn(where)
            for j, block in _blocks(m, "tool_use"):
                pairs.call(block["id"], f"{where}.content[{j}].id")
        else:
            for j, block in _blocks(m, "tool_result"):
                pairs.output(block["tool_use_id"], f"{where}.content[{j}].tool_use_id")
            pairs.turn(where)
    if pairs is None:
        return False
    pairs.turn("messages", ends=True)
    return True


def _system(system: Any) -> str:
    """The system prompt's text: `""` when there is none (`""`, `[]`); a block's text
    is never empty (the Messages API's rule, `_text_block`)."""
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise bad("'system' must be a string or an array of text blocks", "system")
    texts = []
    for k, block in enumerate(system):
        where = f"system[{k}]"
        if _block_type(block, where) != "text":
            raise bad(f"'{where}' must be a text block", where)
        texts.append(_text_block(block, where)["text"])
    return "\n\n".join(texts)


_TOOL_KEYS = frozenset({"name", "description", "input_schema", "type"})


def _tools(tools: Any) -> list[dict[str, Any]]:
    out = []
    for k, tool in enumerate(tools_array(tools)):
        where = f"tools[{k}]"
        if not isinstance(tool, dict):
            raise bad(f"'{where}' must be an object", where)
        if tool.get("type", "custom") != "custom":
            raise bad(
                f"'{where}.type': only custom tools (name, description, input_schema) are "
                "supported",
                f"{where}.type",
            )
        _no_extras_cc(tool, _TOOL_KEYS, where)
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise bad(f"'{where}.name' must be 1-64 of A-Z a-z 0-9 _ -", f"{where}.name")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            # a tool_use block's `input` is always an object: no other schema can match it
            raise bad(
                f'\'{where}.input_schema\' must be an object schema ("type": "object")',
                f"{where}.input_schema",
            )
        fn: dict[str, Any] = {"name": name, "parameters": schema}
        desc = tool.get("description")
        if desc is not None:
            fn["description"] = string(desc, f"{where}.description")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any, out: dict[str, Any]) -> None:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad("'tool_choice' must be an object of type auto, any, tool or none", "tool_choice")
    assert isinstance(choice, dict)
    for k in choice:
        if k not in ("type", "name", "disable_parallel_tool_use"):
            raise bad(f"'tool_choice.{k[:64]}' is not supported", f"tool_choice.{k[:64]}")
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise bad("'tool_choice.name' must name a tool", "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise bad(
                "'tool_choice.disable_parallel_tool_use' must be a boolean",
                "tool_choice.disable_parallel_tool_use",
            )
        if kind != "none":
            out["parallel_tool_calls"] = not parallel


def _metadata(meta: Any) -> str | None:
    if not isinstance(meta, dict):
        raise bad("'metadata' must be an object", "metadata")
    for k in meta:
        if k != "user_id":
            raise bad(f"'metadata.{k[:64]}' is not supported", f"metadata.{k[:64]}")
    user = meta.get("user_id")
    if user is None:
        return None
    if not isinstance(user, str) or len(user) > MAX_USER_ID:
        raise bad(
            f"'metadata.user_id' must be a string of at most {MAX_USER_ID}", "metadata.user_id"
        )
    if CONTROL.search(user):
        raise bad("'metadata.user_id' may not hold control characters", "metadata.user_id")
    return user


def _stop(stop: Any) -> list[str]:
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)
    ):
        raise bad(
            f"'stop_sequences' must be at most {MAX_STOP} non-empty strings",
            "stop_sequences",
        )
    for k, s in enumerate(stop):
        if not s.strip():  # it would end the answer at its first space or line
            raise bad(
                f"'stop_sequences[{k}]' must contain non-whitespace characters",
                f"stop_sequences[{k}]",
            )
    return stop


def to_chat(body: Any, count_only: bool = False) -> dict[str, Any]:
    """A Messages request (parsed JSON) as the chat completions body it means; raises
    the 400 naming what is wrong or unsupported. `count_only`: a `count_tokens` body
    (no `max_tokens`, no sampling)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    allowed = COUNT_FIELDS if count_only else FIELDS
    for name in body:
        if name not in allowed:
            raise bad(
                f"'{str(name)[:64]}' is not supported by this gateway's Messages API", name[:64]
            )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise MissingRequiredParameter("'model' is required: a non-empty string", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' is required: a non-empty array", "messages")
    chat: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        prompt = _system(system)
        if prompt:  # no system prompt (`""`, `[]`) sends no system message
            chat.append({"role": "system", "content": prompt})
    for i, m in enumerate(messages):
        chat.extend(_turn(i, m))
    if _paired_tools(messages) and not body.get("tools"):
        raise bad(
            "requests which include tool_use or tool_result blocks must define 'tools'", "tools"
        )
    out: dict[str, Any] = {"model": model, "messages": chat}
    if not count_only:
        cap = body.get("max_tokens")
        if cap is None:
            raise MissingRequiredParameter("'max_tokens' is required", param="max_tokens")
        number(body, "max_tokens", 1, INT32_MAX, integer=True)
        out["max_tokens"] = cap
        number(body, "temperature", 0, 1, integer=False)
        number(body, "top_p", 0, 1, integer=False)
        number(body, "top_k", 0, INT32_MAX, integer=True)
        for name in ("temperature", "top_p", "top_k"):
            if body.get(name) is not None:
                out[name] = body[name]
        if body.get("stop_sequences") is not None:
            out["stop"] = _stop(body["stop_sequences"])
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise bad("'stream' must be a boolean", "stream")
        if stream:
            out["stream"] = True
            out["stream_options"] = {"include_usage": True}
    if body.get("tools") is not None:
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], out)
        answerable_choice(out.get("tools"), out["tool_choice"])
    if body.get("metadata") is not None:
        user = _metadata(body["metadata"])
        if user is not None:
            out["user"] = user
    thinking = body.get("thinking")
    if thinking is not None and thinking != {"type": "disabled"}:
        raise bad(
            "'thinking' is not supported by this gateway's models: omit it or send "
            '{"type": "disabled"}',
            "thinking",
        )
    return out


class MessagesCodec:
    """`POST /v1/messages`: the Messages body checked and decoded into `Generation`.
    Never exact: the client's bytes are Anthropic's shape, so the chat body goes
    upstream written from the typed request."""

    def decode(self, body: Any) -> tuple[Generation, bool]:
        chat = to_chat(body)
        validate_chat(chat)  # the internal model's own invariants (always holds: tested)
        req: Generation = from_object(Generation, chat, CHAT_TYPED)[0]
        return req, False


class CountCodec:
    """`POST /v1/messages/count_tokens`: the body checked as a message's, less what
    only generating needs (`max_tokens`), decoded into the `Generation` whose prompt
    is counted (its model, messages and tools)."""

    def decode(self, body: Any) -> tuple[Generation, bool]:
        chat = to_chat(body, count_only=True)
        return Generation(
            model=chat["model"], messages=chat["messages"], tools=chat.get("tools")
        ), False


COUNT_CODEC = CountCodec()

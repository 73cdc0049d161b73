"""The OpenAI Responses protocol's request codec: `POST /v1/responses` checked and
decoded into the internal request (`Generation`, chat messages), so every stage runs on
it as on a chat completion.

`check(body)` checks the Responses shape (a 400 naming any field, item or part the
gateway cannot honour, never a silent drop) and returns a `ResponsesRequest`: the
input as items (each with an id, as `GET /v1/responses/{id}/input_items` lists them)
and what the response object repeats. `to_chat` writes the chat body it means, after
the conversation of the response it continues (`previous_response_id`). Tool items
pair up as in OpenAI's API (api/checks.py `ToolPairs`, one rule with the Messages codec): each
`function_call_output` answers a `function_call` before it (in the input, or the calls
the continued response ended with), each call is answered before the conversation
goes on, and no call id is used twice. Each part type has its own members and each
role its own part types; an item's `id` and `status` are the API's or a 400.


| Responses | chat completions |
|---|---|
| `instructions` | a first `system` message (not carried into a continuation, as OpenAI does) |
| `input`: a string, or `message` items (`input_text`, `input_image` by URL, `output_text` of earlier assistant turns) | messages with text and `image_url` parts |
| `function_call` items | an assistant message's `tool_calls` |
| `function_call_output` items | `tool` messages |
| `tools` (function), `tool_choice` | function `tools`, `tool_choice` |
| `text.format` (`text`, `json_object`, `json_schema`) | `response_format` |
| `max_output_tokens` (at least 16, as in OpenAI's API), `temperature`, `top_p`, `parallel_tool_calls`, `user`, `prompt_cache_key` | the same |
| `stream` | `stream` with `include_usage` |
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable
from typing import Any

import msgspec

from switchyard.api.checks import ToolPairs, bad, flag, no_extras, number, string
from switchyard.entropy import RandomPool
from switchyard.errors import InvalidRequest, MissingRequiredParameter
from switchyard.policy.validate import CONTROL, answerable_choice, tools_array

# Top-level members the gateway honours; any other is refused by name.
FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "text",
        "max_output_tokens",
        "temperature",
        "top_p",
        "metadata",
        "store",
        "previous_response_id",
        "stream",
        "background",
        "parallel_tool_calls",
        "user",
        "prompt_cache_key",
        "include",  # accepted empty (the Agents SDK always sends it)
        "truncation",  # accepted as "disabled" (the default)
    }
)
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_ID = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{16,64}")
INT32_MAX = 2**31 - 1
MIN_OUTPUT_TOKENS = 16  # OpenAI's API refuses a smaller `max_output_tokens`
MAX_FORMAT_DESCRIPTION = 4096  # characters of `text.format.description` sent upstream
Ids = Callable[[str], str]  # prefix -> a new unguessable id


def new_item_id(prefix: str) -> str:
    """A one-off id: `prefix`, then 128 random bits (IdPool makes them in bulk)."""
    return f"{prefix}_{secrets.token_hex(16)}"


class IdPool(RandomPool):
    """Unguessable ids, `prefix_` and 128 bits from the OS's CSPRNG, drawn from a pool
    (entropy.py: a request makes three, and each `getrandom` call costs ~15 us). The
    pool's bytes are turned into hex digits a block at a time, 32 of them an id (a
    `take` and a `hex` per id cost more than the rest of making one); a child made by
    `fork` forgets them with the pool's bytes, so no id is handed out twice. Used on
    the event loop only."""

    def __init__(self) -> None:
        super().__init__()
        self._digits = ""
        self._next = 0

    def __call__(self, prefix: str) -> str:
        at = self._next
        if at + 32 > len(self._digits):
            self._digits, at = self.take(_ID_BLOCK).hex(), 0
        self._next = at + 32
        return f"{prefix}_{self._digits[at : at + 32]}"

    def timed(self, prefix: str) -> str:
        """A stored object's id: `prefix_`, the milliseconds since the epoch (12 hex
        digits), then 80 random bits (20 digits), as the gateway's request ids and
        UUIDv7 are (and as OpenAI's own response ids begin with their creation time).
        Still unguessable (80 bits a millisecond), and each new id lands at its
        tenant's end of the stored responses' key index: a random key is written into
        a random leaf page of it, about twice the ledger writer's work per stored
        response (docs/benchmarks/2026-12-06-writer-and-ids.md)."""
        at = self._next
        if at + 20 > len(self._digits):
            self._digits, at = self.take(_ID_BLOCK).hex(), 0
        self._next = at + 20
        return f"{prefix}_{int(time.time() * 1000):012x}{self._digits[at : at + 20]}"

    def _forget(self) -> None:
        super()._forget()
        self._digits, self._next = "", 0


_ID_BLOCK = 1024  # bytes of the pool turned into hex digits at once: 64 ids


class ResponsesRequest(msgspec.Struct):
    """A checked Responses request: the chat request it means, less the conversation it
    continues (`to_chat` adds that), and what the response object repeats. A struct:
    made once per request, it costs a quarter of a dataclass's keyword `__init__`."""

    model: str
    items: list[dict[str, Any]]  # the input as items, each with an id
    messages: list[dict[str, Any]]  # those items as chat messages
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    echo: dict[str, Any] = msgspec.field(default_factory=dict)  # what the response repeats
    chat: dict[str, Any] = msgspec.field(default_factory=dict)  # the chat fields but messages


# Each part type's own members (a member of another type is refused by name, never
# dropped), and the part types each role's message holds.
_PART_KEYS: dict[str, frozenset[str]] = {
    "input_text": frozenset({"type", "text"}),
    "output_text": frozenset({"type", "text", "annotations", "logprobs"}),
    "refusal": frozenset({"type", "refusal"}),
    "input_image": frozenset({"type", "image_url", "detail"}),
}
_ANY_PART_KEYS = frozenset().union(*_PART_KEYS.values())  # a type not served: its member named
_ASSISTANT_PARTS = ("output_text", "refusal")
_INPUT_PARTS = ("input_text", "input_image")


def _part(part: Any, role: str, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(kind, str):
        raise bad(f"'{where}' must be a content part with a 'type'", where)
    assert isinstance(part, dict)
    no_extras(part, _PART_KEYS.get(kind, _ANY_PART_KEYS), where)
    allowed = _ASSISTANT_PARTS if role == "assistant" else _INPUT_PARTS
    if kind not in allowed:
        if kind in _PART_KEYS:  # a part of the other side of the conversation
            raise bad(
                f"'{where}': invalid part type {kind!r} in a {role} message: supported "
                f"values are {allowed[0]!r} and {allowed[1]!r}",
                where,
            )
        raise bad(f"'{where}': content part type {kind[:40]!r} is not supported here", where)
    if kind != "input_image":
        key = "refusal" if kind == "refusal" else "text"
        return {"type": "text", "text": string(part.get(key), f"{where}.{key}")}
    url = part.get("image_url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://", "data:image/")):
        raise bad(
            f"'{where}.image_url' must be an http(s) or data:image URL (file_id is not supported)",
            f"{where}.image_url",
        )
    image: dict[str, Any] = {"url": url}
    detail = part.get("detail")
    if detail is not None:
        if detail not in ("auto", "low", "high"):
            raise bad(f"'{where}.detail' must be auto, low or high", f"{where}.detail")
        image["detail"] = detail
    return {"type": "image_url", "image_url": image}


def _content(content: Any, role: str, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise bad(f"'{where}' must be a string or a non-empty array of parts", where)
    parts = [_part(p, role, f"{where}[{j}]") for j, p in enumerate(content)]
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts) if role == "assistant" else parts
    return parts


_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
_CALL_KEYS = frozenset({"type", "call_id", "name", "arguments", "id", "status"})
_OUTPUT_KEYS = frozenset({"type", "call_id", "output", "id", "status"})


def _item(i: int, item: Any, out: list[dict[str, Any]], ids: Ids) -> dict[str, Any]:
    """Append one input item's chat message(s) to `out`; return the item as stored."""
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise bad(f"'{where}' must be an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        no_extras(item, _MESSAGE_KEYS, where)
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad(
                f"'{where}.role' must be user, assistant, system or developer", f"{where}.role"
            )
        content = _content(item.get("content"), str(role), f"{where}.content")
        out.append({"role": role, "content": content})
        stored = {"type": "message", "role": role, "content": _as_parts(item["content"], role)}
        return {"id": _given_id(item, where) or ids("msg"), **stored}
    if kind == "function_call":
        no_extras(item, _CALL_KEYS, where)
        call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
        if not isinstance(call_id, str) or not _ID.fullmatch(call_id):
            raise bad(f"'{where}.call_id' must be a call id", f"{where}.call_id")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad(f"'{where}.name' must be 1-64 of A-Z a-z 0-9 _ - .", f"{where}.name")
        if not isinstance(args, str):
            raise bad(f"'{where}.arguments' must be a JSON string", f"{where}.arguments")
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)  # parallel calls: one assistant turn
        elif (
            last is not None
            and last["role"] == "assistant"
            and isinstance(last.get("content"), str)
        ):
            last["tool_calls"] = [call]
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        stored = {"type": "function_call", "call_id": call_id, "name": name, "arguments": args}
        return {"id": _given_id(item, where) or ids("fc"), **stored}
    if kind == "function_call_output":
        no_extras(item, _OUTPUT_KEYS, where)
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not _ID.fullmatch(call_id):
            raise bad(f"'{where}.call_id' must be a call id", f"{where}.call_id")
        if isinstance(output, list):
            texts = [_part(p, "user", f"{where}.output[{j}]") for j, p in enumerate(output)]
            if any(t["type"] != "text" for t in texts):
                raise bad(f"'{where}.output' holds text parts only here", f"{where}.output")
            output = "".join(t["text"] for t in texts)
        elif not isinstance(output, str):
            raise bad(f"'{where}.output' must be a string", f"{where}.output")
        out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        stored = {"type": "function_call_output", "call_id": call_id, "output": output}
        return {"id": _given_id(item, where) or ids("fco"), **stored}
    raise bad(f"'{where}': item type {str(kind)[:40]!r} is not supported", f"{where}.type")


def _as_parts(content: Any, role: str) -> list[Any]:
    """A message item's content as the parts an input item lists (a string is one
    text part: `output_text` for the assistant, else `input_text`)."""
    if isinstance(content, str):
        kind = "output_text" if role == "assistant" else "input_text"
        part: dict[str, Any] = {"type": kind, "text": content}
        if role == "assistant":
            part["annotations"] = []
        return [part]
    return list(content)


def open_calls(history: list[dict[str, Any]]) -> dict[str, str | None]:
    """The tool calls a stored conversation (chat messages) ends with unanswered: the
    last assistant turn's calls no `tool` message after it answers."""
    pending: dict[str, str | None] = {}
    for m in history:
        role = m.get("role")
        if role == "tool":
            pending.pop(str(m.get("tool_call_id")), None)
        elif role == "assistant" and m.get("tool_calls"):
            pending = {str(c.get("id")): None for c in m["tool_calls"]}
        else:
            pending = {}
    return pending


def used_calls(history: list[dict[str, Any]]) -> set[str]:
    """Every tool call id a stored conversation (chat messages) used, answered or not."""
    return {
        c["id"]
        for m in history
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list)
        for c in m["tool_calls"]
        if isinstance(c, dict) and isinstance(c.get("id"), str)
    }


def _paired(items: list[dict[str, Any]], history: list[dict[str, Any]] | None) -> None:
    """The input's calls and outputs pair up, with the calls `history` (the stored
    conversation it continues, if any) left open (`ToolPairs`), and no call of the
    input has the id of any call of `history`: no call id is used twice in one
    conversation. `ToolPairs` knows the calls left open; the ids of those answered are
    checked here, before each call reaches it, as `ToolPairs.call` checks its own."""
    pending = open_calls(history) if history else None
    if not pending and all(item["type"] == "message" for item in items):
        return  # the common input: no tool item, nothing to answer
    # The ids it used and closed (those left open `ToolPairs` is given).
    used = used_calls(history).difference(pending or ()) if history else set()
    pairs = ToolPairs("function_call", "function_call_output", pending)
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "function_call":
            where = f"input[{i}].call_id"
            if item["call_id"] in used:
                raise bad(
                    f"'{where}': the function_call id {item['call_id']!r} is the id of "
                    "the response this one continues too",
                    where,
                )
            pairs.call(item["call_id"], where)
        elif kind == "function_call_output":
            pairs.output(item["call_id"], f"input[{i}].call_id")
        else:
            pairs.turn(f"input[{i}]")
    pairs.turn("input", ends=True)


def _unique_ids(items: list[dict[str, Any]]) -> None:
    """Each item's id is its own: the input items are listed and paged by id (`after`,
    `before`), and a repeated id would make a cursor name two places."""
    seen: set[str] = set()
    for i, item in enumerate(items):
        if item["id"] in seen:
            raise bad(f"input[{i}].id repeats the id of an earlier item", f"input[{i}].id")
        seen.add(item["id"])


ITEM_STATUS = frozenset({"in_progress", "completed", "incomplete"})


def _given_id(item: dict[str, Any], where: str) -> str | None:
    """The item's own id (None: the gateway makes one), and its `status` checked: an id
    names the item in `GET /v1/responses/{id}/input_items` and pages it, so one that is
    no id is refused, never replaced by another the client does not know."""
    status = item.get("status")
    if status is not None and (not isinstance(status, str) or status not in ITEM_STATUS):
        raise bad(
            f"'{where}.status' must be in_progress, completed or incomplete", f"{where}.status"
        )
    got = item.get("id")
    if got is None:
        return None
    if not isinstance(got, str) or not _ID.fullmatch(got):
        raise bad(f"'{where}.id' must be an id: 1-128 of A-Z a-z 0-9 _ . : -", f"{where}.id")
    return got


_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})


def _tools(tools: Any) -> list[dict[str, Any]]:
    out = []
    for k, tool in enumerate(tools_array(tools)):
        where = f"tools[{k}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad(f"'{where}': only function tools are supported", f"{where}.type")
        no_extras(tool, _TOOL_KEYS, where)
        name = tool.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad(f"'{where}.name' must be 1-64 of A-Z a-z 0-9 _ - .", f"{where}.name")
        fn: dict[str, Any] = {"name": name}
        params = tool.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise bad(f"'{where}.parameters' must be a JSON Schema", f"{where}.parameters")
            fn["parameters"] = params
        if tool.get("description") is not None:
            fn["description"] = string(tool["description"], f"{where}.description")
        if tool.get("strict") is not None:
            if not isinstance(tool["strict"], bool):
                raise bad(f"'{where}.strict' must be a boolean", f"{where}.strict")
            fn["strict"] = tool["strict"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if isinstance(name, str) and _NAME.fullmatch(name) and set(choice) <= {"type", "name"}:
            return {"type": "function", "function": {"name": name}}
    raise bad(
        "'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", "
        '"name": ...}',
        "tool_choice",
    )


def _text_format(config: Any) -> dict[str, Any] | None:
    if not isinstance(config, dict):
        raise bad("'text' must be an object", "text")
    no_extras(config, frozenset({"format"}), "text")
    fmt = config.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        no_extras(
            fmt, frozenset({"type", "name", "schema", "strict", "description"}), "text.format"
        )
        name, schema = fmt.get("name"), fmt.get("schema")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad("'text.format.name' must be 1-64 of A-Z a-z 0-9 _ - .", "text.format.name")
        if not isinstance(schema, dict):
            raise bad("'text.format.schema' must be a JSON Schema object", "text.format.schema")
        spec: dict[str, Any] = {"name": name, "schema": schema}
        description, strict = fmt.get("description"), fmt.get("strict")
        if description is not None:  # tells the model what the schema is for
            if not isinstance(description, str) or len(description) > MAX_FORMAT_DESCRIPTION:
                raise bad(
                    "'text.format.description' must be a string of at most "
                    f"{MAX_FORMAT_DESCRIPTION} characters",
                    "text.format.description",
                )
            spec["description"] = description
        if strict is not None:
            if not isinstance(strict, bool):
                raise bad("'text.format.strict' must be a boolean", "text.format.strict")
            spec["strict"] = strict
        return {"type": "json_schema", "json_schema": spec}
    raise bad("'text.format.type' must be text, json_object or json_schema", "text.format.type")


def _metadata(meta: Any) -> dict[str, str]:
    if not isinstance(meta, dict) or len(meta) > 16:
        raise bad("'metadata' must be an object of at most 16 pairs", "metadata")
    for k, v in meta.items():
        if len(k) > 64 or not isinstance(v, str) or len(v) > 512:
            raise bad(
                "'metadata' keys are at most 64 characters, values strings of at most 512",
                "metadata",
            )
    return meta


def check(body: Any, ids: Ids = new_item_id) -> ResponsesRequest:
    """A Responses request (parsed JSON) checked; raises the 400 naming what is wrong
    or not supported. `ids` makes the input items' ids."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    for name in body:
        if name not in FIELDS:
            raise bad(f"'{name[:64]}' is not supported by this gateway's Responses API", name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise MissingRequiredParameter("'model' is required: a non-empty string", param="model")
    raw = body.get("input")
    messages: list[dict[str, Any]] = []
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
        items = [
            {
                "id": ids("msg"),
                "type": "message",
                "role": "user",
                "content": _as_parts(raw, "user"),
            }
        ]
    elif isinstance(raw, list) and raw:
        items = [_item(i, item, messages, ids) for i, item in enumerate(raw)]
        _unique_ids(items)
        if body.get("previous_response_id") is None:  # else with its history (to_chat)
            _paired(items, None)
    else:
        raise MissingRequiredParameter(
            "'input' is required: a string or a non-empty array of items", param="input"
        )
    instructions = body.get("instructions")
    if instructions is not None:
        string(instructions, "instructions")
    prev = body.get("previous_response_id")
    if prev is not None and (not isinstance(prev, str) or not RESPONSE_ID.fullmatch(prev)):
        raise bad("'previous_response_id' must be a response id (resp_...)", "previous_response_id")
    cap = body.get("max_output_tokens")
    if type(cap) is int and cap < MIN_OUTPUT_TOKENS:  # OpenAI's words for it
        raise bad(
            "Invalid 'max_output_tokens': integer below minimum value. Expected a value "
            f">= {MIN_OUTPUT_TOKENS}, but got {cap} instead.",
            "max_output_tokens",
        )
    number(body, "max_output_tokens", MIN_OUTPUT_TOKENS, INT32_MAX, integer=True)
    number(body, "temperature", 0, 2, integer=False)
    number(body, "top_p", 0, 1, integer=False)
    include = body.get("include")
    if include is not None and include != []:
        raise bad("'include' is not supported (send it empty or leave it out)", "include")
    truncation = body.get("truncation")
    if truncation is not None and truncation != "disabled":
        raise bad("'truncation' must be 'disabled' here (no automatic truncation)", "truncation")
    # Each member read once (a request makes one check; most members are not sent), the
    # chat fields in the order the chat body lists them.
    tools, choice, text = body.get("tools"), body.get("tool_choice"), body.get("text")
    chat: dict[str, Any] = {}
    echo: dict[str, Any] = {"tools": tools or [], "tool_choice": "auto"}
    if tools is not None:
        chat["tools"] = _tools(tools)
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice)
        answerable_choice(chat.get("tools"), chat["tool_choice"])
        echo["tool_choice"] = choice
    if text is not None:
        fmt = _text_format(text)
        if fmt is not None:
            chat["response_format"] = fmt
        echo["text"] = text
    limit, temperature, top_p = (
        body.get("max_output_tokens"),
        body.get("temperature"),
        body.get("top_p"),
    )
    if limit is not None:
        chat["max_tokens"] = echo["max_output_tokens"] = limit
    if temperature is not None:
        chat["temperature"] = echo["temperature"] = temperature
    if top_p is not None:
        chat["top_p"] = echo["top_p"] = top_p
    parallel = flag(body, "parallel_tool_calls", True)
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = parallel
    echo["parallel_tool_calls"] = parallel
    for name in ("user", "prompt_cache_key"):
        v = body.get(name)
        if v is not None:
            if not isinstance(v, str) or len(v) > 512:
                raise bad(f"'{name}' must be a string of at most 512 characters", name)
            if name == "user" and CONTROL.search(v):  # as chat's `user` (validate)
                raise bad("'user' may not hold control characters", name)
            chat[name] = v
    meta = body.get("metadata")
    if meta is not None:
        echo["metadata"] = _metadata(meta)
    stream = flag(body, "stream", False)
    background = flag(body, "background", False)
    store = flag(body, "store", True)
    if background and not store:
        raise bad("a background response must be stored ('store' true)", "background")
    if background and stream:
        raise bad(
            "'background' with 'stream' is not supported: poll GET /v1/responses/{id}", "background"
        )
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return ResponsesRequest(
        model=model,
        items=items,
        messages=messages,
        instructions=instructions,
        previous_response_id=prev,
        store=store,
        background=background,
        stream=stream,
        echo=echo,
        chat=chat,
    )


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The chat completions body the request means: its instructions, the conversation
    it continues (chat messages, as stored with that response), then its own input.
    Raises the 400 when a continuation's tool items do not pair up with the calls that
    conversation left open (`ToolPairs`)."""
    if req.previous_response_id is not None:
        _paired(req.items, history)
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    messages.extend(history or ())
    messages.extend(req.messages)
    return {"model": req.model, "messages": messages, **req.chat}

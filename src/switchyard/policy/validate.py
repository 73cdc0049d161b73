"""Request validation: the shape checks done before any costly work.

Hand-written rather than a pydantic model on purpose: it runs on every request, it
names the offending field the way OpenAI does (`messages[2].role`), and it leaves
every field it does not know untouched so the upstream sees the client's request.
"""

from __future__ import annotations

import re
from collections.abc import Container, Mapping
from typing import TYPE_CHECKING, Any

from switchyard.engines.token_ids import refusal as token_ids_refusal
from switchyard.errors import InvalidRequest, MissingRequiredParameter, ModelNotFound
from switchyard.request import EMBEDDING_FIELDS, GENERATION_FIELDS

if TYPE_CHECKING:
    from switchyard.config import ModelConfig
    from switchyard.pipeline import RequestContext

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise MissingRequiredParameter("you must provide a model parameter", param="model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string", param="model")
    return model


_INT = ((int,), "an integer")
_NUM = ((int, float), "a number")
_BOOL = ((bool,), "a boolean")
_STR = ((str,), "a string")
INT32_MAX = 2**31 - 1
INT64 = 2**63
# Typed optional fields: name -> (accepted types, what the error calls them).
_TYPED: dict[str, tuple[tuple[type[Any], ...], str]] = {
    "stream": _BOOL,
    "max_tokens": _INT,
    "max_completion_tokens": _INT,
    "n": _INT,
    "seed": _INT,
    "top_k": _INT,
    "temperature": _NUM,
    "top_p": _NUM,
    "min_p": _NUM,
    "presence_penalty": _NUM,
    "frequency_penalty": _NUM,
    "repeat_penalty": _NUM,
    "logprobs": _BOOL,  # chat; completions take an integer (validate_completion)
    "top_logprobs": _INT,
    "return_token_ids": _BOOL,  # vLLM's option; engines/token_ids.py
    "parallel_tool_calls": _BOOL,
    "store": _BOOL,
    "user": _STR,
    "reasoning_effort": _STR,
    "service_tier": _STR,
    "echo": _BOOL,
    "best_of": _INT,
    "suffix": _STR,
}
_AT_LEAST_1 = frozenset({"max_tokens", "max_completion_tokens", "n", "best_of"})
# Inclusive bounds, as the official API documents them (token counts: 32-bit).
_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0, 2),
    "top_p": (0, 1),
    "min_p": (0, 1),
    "presence_penalty": (-2, 2),
    "frequency_penalty": (-2, 2),
    "max_tokens": (1, INT32_MAX),
    "max_completion_tokens": (1, INT32_MAX),
    "n": (1, 128),
    "best_of": (1, 20),
    "top_logprobs": (0, 20),
    "top_k": (-1, INT32_MAX),
    "seed": (-INT64, INT64 - 1),
    "repeat_penalty": (0, 10),
}
_MAX_STRINGS = {"user": 512, "reasoning_effort": 32, "service_tier": 32, "suffix": 100_000}
# An end user's id (`user`, Messages' `metadata.user_id`) is an identifier: no line
# breaks, escapes or other control characters to forge a log line or a header with.
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


MAX_STOP = 4  # stop strings, as the official API bounds them
# Each stop string's length; api/messages_codec.py bounds `stop_sequences` alike.
MAX_STOP_CHARS = 1000


def _stop(body: dict[str, Any], stop: Any) -> None:
    if isinstance(stop, str):
        _stop_string(stop, "stop")
        return
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP
        or not all(isinstance(s, str) for s in stop)
    ):
        raise InvalidRequest(
            f"'stop' must be a string or a list of at most {MAX_STOP} strings", param="stop"
        )
    for k, s in enumerate(stop):
        _stop_string(s, f"stop[{k}]")


def _stop_string(s: str, where: str) -> None:
    # An empty one ends every answer at once; a long one is work the engine does on
    # every token.
    if not 0 < len(s) <= MAX_STOP_CHARS:
        raise InvalidRequest(
            f"'{where}' must be a string of 1 to {MAX_STOP_CHARS} characters", param=where
        )


def _stream_options(body: dict[str, Any], so: Any) -> None:
    if not isinstance(so, dict):
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")
    case_variants(so, _STREAM_OPTIONS, "stream_options")
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
    if len(lb) > 1024:
        raise InvalidRequest("'logit_bias' may hold at most 1024 tokens", param="logit_bias")
    for token, bias in lb.items():
        if not (token.isascii() and token.isdigit() and len(token) <= 10):
            raise InvalidRequest(
                "'logit_bias' keys must be token ids (integers)", param=f"logit_bias.{token}"[:80]
            )
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise InvalidRequest(
                "'logit_bias' values must be numbers from -100 to 100",
                param=f"logit_bias.{token}",
            )


def _tool_choice(body: dict[str, Any], choice: Any) -> None:
    if isinstance(choice, dict):
        case_variants(choice, _CHOICE, "tool_choice")
        if isinstance(choice.get("function"), dict):
            case_variants(choice["function"], _CHOSEN, "tool_choice.function")
    if not (
        choice in ("none", "auto", "required")
        or (
            isinstance(choice, dict)
            and choice.get("type") == "function"
            and isinstance(choice.get("function"), dict)
            and _NAME.fullmatch(str(choice["function"].get("name", "")))
        )
    ):
        raise InvalidRequest(
            "'tool_choice' must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    answerable_choice(body.get("tools"), choice)


def answerable_choice(tools: Any, choice: Any) -> None:
    """A `tool_choice` that forces a call (`required`, or a function by name) must be
    answerable by a tool the request offers: the official APIs refuse one that is not,
    so it is refused here rather than upstream. Both in chat's shape, the choice
    already shape-checked; every protocol's check ends here (chat, Responses,
    Messages)."""
    if choice == "none" or choice == "auto":
        return
    if not tools:
        raise InvalidRequest(
            "'tool_choice' forces a tool call, and the request has no 'tools'", param="tool_choice"
        )
    if isinstance(choice, dict):
        forced = choice["function"]["name"]
        if not any(
            isinstance(t, dict)
            and isinstance(t.get("function"), dict)
            and t["function"].get("name") == forced
            for t in tools
        ):
            raise InvalidRequest(
                f"'tool_choice' names the tool '{forced}', which is not in 'tools'",
                param="tool_choice",
            )


def _response_format(body: dict[str, Any], fmt: Any) -> None:
    if isinstance(fmt, dict):
        case_variants(fmt, _FORMAT, "response_format")
        if isinstance(fmt.get("json_schema"), dict):
            case_variants(fmt["json_schema"], _JSON_SCHEMA, "response_format.json_schema")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidRequest(
            "'response_format' must be an object with 'type' text, json_object or json_schema",
            param="response_format",
        )
    if kind == "json_schema":
        schema = fmt.get("json_schema")
        if not isinstance(schema, dict) or not _NAME.fullmatch(str(schema.get("name", ""))):
            raise InvalidRequest(
                "'response_format.json_schema' must be an object with a 'name'",
                param="response_format.json_schema",
            )
        if "schema" in schema and not isinstance(schema["schema"], dict):
            raise InvalidRequest(
                "'response_format.json_schema.schema' must be an object",
                param="response_format.json_schema.schema",
            )


def _metadata(body: dict[str, Any], meta: Any) -> None:
    if not isinstance(meta, dict) or len(meta) > 16:
        raise InvalidRequest("'metadata' must be an object of at most 16 pairs", param="metadata")
    for k, v in meta.items():
        if len(k) > 64 or not isinstance(v, str) or len(v) > 512:
            raise InvalidRequest(
                "'metadata' keys are at most 64 characters, values strings of at most 512",
                param="metadata",
            )


def _lora(body: dict[str, Any], v: Any) -> None:
    # llama-server applies the adapters a request lists by id: a client listing them
    # would bypass adapter authorization. The gateway sets it from the model name.
    raise InvalidRequest(
        "'lora' is set by the gateway: name the adapter as the model instead", param="lora"
    )


def _engine_verbose(body: dict[str, Any], v: Any) -> None:
    # llama-server's own switches: they add its native result (the templated prompt,
    # its settings) to the reply, outside the OpenAI shape. The gateway sets them when
    # it needs them; a client asks for token ids with return_token_ids.
    raise InvalidRequest(
        "'verbose' and 'return_tokens' are set by the gateway: ask for 'return_token_ids'",
        param="return_token_ids",
    )


# The engines' own request members that the OpenAI shape has an answer for, or that
# would undo a decision the gateway made: each lifts the output cap admission reserved
# and the budget allowed, adds choices nobody reserved or bills, constrains the output
# past the JSON-schema capability check (execute/compat.py), returns data outside the
# reply's shape, or picks what the gateway places. Refused by name, with what to send
# instead (docs/guides/api.md lists them); the harmless ones (sampling knobs,
# `cache_prompt`, `n_keep`, `ignore_eos`, `min_tokens`, ...) pass.
_GRAMMAR = (
    "constrains the output past the model's JSON-schema capability check: send 'response_format'"
)
ENGINE_NATIVE: dict[str, str] = {
    # llama-server
    "n_predict": "llama-server's own output cap, read ahead of 'max_tokens': send 'max_tokens'",
    "n_cmpl": "llama-server's own number of choices, never reserved or billed: send 'n'",
    "n_probs": "llama-server's own token probabilities, outside the reply's shape: "
    "send 'logprobs' and 'top_logprobs'",
    "grammar": _GRAMMAR,
    "json_schema": _GRAMMAR,
    "id_slot": "llama-server's slot, which the gateway places: leave it out",
    # vLLM
    "structured_outputs": _GRAMMAR,
    "guided_json": _GRAMMAR,
    "guided_regex": _GRAMMAR,
    "guided_choice": _GRAMMAR,
    "guided_grammar": _GRAMMAR,
    "prompt_logprobs": "vLLM's own prompt log probabilities, outside the reply's shape: "
    "send 'logprobs' and 'top_logprobs'",
}


def _short_string(v: Any, longest: int) -> bool:
    """A non-empty string of at most `longest` characters, without control characters:
    an id or a name the upstream reads as one."""
    return isinstance(v, str) and 0 < len(v) <= longest and not CONTROL.search(v)


def _members(obj: dict[str, Any], known: Container[str], where: str) -> None:
    for name in obj:
        if name not in known:
            raise InvalidRequest(
                f"'{where}' has no member {name[:40]!r}", param=f"{where}.{name}"[:100]
            )


_MODALITIES = ("text", "audio")


def _modalities(body: dict[str, Any], v: Any) -> None:
    if (
        not isinstance(v, list)
        or not all(m in _MODALITIES for m in v)
        or len(set(v)) != len(v)  # strings by now
    ):
        raise InvalidRequest(
            "'modalities' must be a list of distinct 'text' and 'audio'", param="modalities"
        )
    if "audio" in v and body.get("audio") is None:
        raise InvalidRequest(
            "'audio' is required when 'modalities' asks for audio output", param="audio"
        )


# The audio output formats and the longest voice name or custom voice id.
_AUDIO_OUT = ("wav", "aac", "mp3", "flac", "opus", "pcm16")
MAX_VOICE = 64


def _audio(body: dict[str, Any], v: Any) -> None:
    if not isinstance(v, dict):
        raise InvalidRequest("'audio' must be an object with 'voice' and 'format'", param="audio")
    case_variants(v, _AUDIO, "audio")
    if v.get("format") not in _AUDIO_OUT:
        raise InvalidRequest(
            f"'audio.format' must be one of {', '.join(_AUDIO_OUT)}", param="audio.format"
        )
    voice = v.get("voice")
    if isinstance(voice, dict):
        case_variants(voice, _VOICE, "audio.voice")
        voice = voice.get("id")
    if not _short_string(voice, MAX_VOICE):
        raise InvalidRequest(
            f"'audio.voice' must be a voice's name or {{'id': ...}}, at most {MAX_VOICE} "
            "characters",
            param="audio.voice",
        )


def _prediction(body: dict[str, Any], v: Any) -> None:
    if not isinstance(v, dict):
        raise InvalidRequest(
            "'prediction' must be an object {'type': 'content', 'content': ...}",
            param="prediction",
        )
    case_variants(v, _PREDICTION, "prediction")
    if v.get("type") != "content":
        raise InvalidRequest("'prediction.type' must be 'content'", param="prediction.type")
    content = v.get("content")
    if isinstance(content, str):
        return
    if not isinstance(content, list) or not content:
        raise InvalidRequest(
            "'prediction.content' must be a string or a non-empty array of text parts",
            param="prediction.content",
        )
    for k, part in enumerate(content):
        if isinstance(part, dict) and not _TEXT_PART.issuperset(part):
            case_variants(part, _TEXT_PART, f"prediction.content[{k}]")
        if not (
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            raise InvalidRequest(
                f"'prediction.content[{k}]' must be a text part {{'type': 'text', 'text': ...}}",
                param=f"prediction.content[{k}]",
            )


_SEARCH_SIZES = ("low", "medium", "high")
# An approximate location's members and their longest values (country: ISO 3166 alpha-2).
_LOCATION = {"city": 128, "region": 128, "country": 2, "timezone": 64}
_WHERE = "web_search_options.user_location"


def _web_search_options(body: dict[str, Any], v: Any) -> None:
    if not isinstance(v, dict):
        raise InvalidRequest("'web_search_options' must be an object", param="web_search_options")
    _members(v, ("search_context_size", "user_location"), "web_search_options")
    if "search_context_size" in v and v["search_context_size"] not in _SEARCH_SIZES:
        raise InvalidRequest(
            "'web_search_options.search_context_size' must be low, medium or high",
            param="web_search_options.search_context_size",
        )
    loc = v.get("user_location")
    if loc is None:
        return
    if not isinstance(loc, dict):
        raise InvalidRequest(
            f"'{_WHERE}' must be an object {{'type': 'approximate', 'approximate': {{...}}}}",
            param=_WHERE,
        )
    _members(loc, ("type", "approximate"), _WHERE)
    if loc.get("type") != "approximate":
        raise InvalidRequest(f"'{_WHERE}.type' must be 'approximate'", param=f"{_WHERE}.type")
    near = loc.get("approximate")
    if not isinstance(near, dict):
        raise InvalidRequest(
            f"'{_WHERE}.approximate' must be an object of {', '.join(_LOCATION)}",
            param=f"{_WHERE}.approximate",
        )
    _members(near, _LOCATION, f"{_WHERE}.approximate")
    for name, value in near.items():
        if name == "country":
            ok = isinstance(value, str) and len(value) == 2 and value.isascii() and value.isalpha()
            what = "a two-letter country code"
        else:
            ok = _short_string(value, _LOCATION[name])
            what = f"a string of 1 to {_LOCATION[name]} characters"
        if not ok:
            raise InvalidRequest(
                f"'{_WHERE}.approximate.{name}' must be {what}",
                param=f"{_WHERE}.approximate.{name}",
            )


# Chat's own output options (the official API's shapes): a completion does not read
# them (they stay in its `extra`).
_CHAT_OTHER: dict[str, Any] = {
    "modalities": _modalities,
    "audio": _audio,
    "prediction": _prediction,
    "web_search_options": _web_search_options,
}


_OTHER: dict[str, Any] = {
    "lora": _lora,
    "verbose": _engine_verbose,
    "return_tokens": _engine_verbose,
    "stop": _stop,
    "stream_options": _stream_options,
    "logit_bias": _logit_bias,
    "tool_choice": _tool_choice,
    "response_format": _response_format,
    "metadata": _metadata,
}

# Function and schema names, as the official API allows them.
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_PART_TYPES = frozenset({"text", "image_url", "input_audio", "file", "refusal"})
# The top-level fields of each endpoint that the gateway reads or forwards knowingly;
# validation.unknown_fields: reject refuses any other.
CHAT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "tools",
        "functions",
        "function_call",
        *_TYPED,
        *_OTHER,
        *_CHAT_OTHER,
    }
)
COMPLETION_FIELDS = frozenset({"model", "prompt", *_TYPED, *_OTHER})

# Every top-level member the gateway reads, refuses or replaces, by its case-folded
# name. An upstream whose JSON decoder matches names without case (Go's `encoding/json`,
# the decoder of many OpenAI-compatible servers; it also folds the Kelvin sign U+212A
# to `k` and the long s U+017F to `s`) reads `MODEL` or `Max_Tokens` as `model` or
# `max_tokens`, the later of two winning: a member the gateway forwards as unknown
# would pick the model or lift the output cap past what policy checked, allowed and
# reserved. Such a spelling is refused by name (`case_variant`).
_CASELESS: dict[str, str] = {
    name.casefold(): name
    for name in sorted(
        CHAT_FIELDS
        | COMPLETION_FIELDS
        | EMBEDDING_FIELDS
        | GENERATION_FIELDS
        | {"priority"}
        | ENGINE_NATIVE.keys()
    )
}


def case_variant(name: str) -> None:
    """400 when the member `name` is a known member's name spelt in other letters
    (`_CASELESS`); the common member (a lower-case ASCII name) costs two checks."""
    if name.isascii() and name.islower():
        return
    _variant(name, _CASELESS, "")


def _variant(name: str, caseless: Mapping[str, str], where: str) -> None:
    """400 when `name`, a member of the object at `where` ("" for the body), folds to
    one of `caseless`' names (by its case-folded spelling) and is not that name."""
    known = caseless.get(name.casefold())
    if known is not None and known != name:
        shown = name[:64].encode("ascii", "backslashreplace").decode()
        param = f"{where}.{shown}" if where else shown
        raise InvalidRequest(
            f"'{param}' is '{known}' spelt otherwise: member names are case-sensitive, and "
            f"an upstream that matches them without case would read it as '{known}'; "
            f"send '{known}' once",
            param=param,
        )


def _known(*names: str) -> frozenset[str]:
    """The names of an object's members the gateway reads (`case_variants`)."""
    known = frozenset(names)
    _CASELESS_OF[known] = {name.casefold(): name for name in names}
    return known


_CASELESS_OF: dict[frozenset[str], dict[str, str]] = {}  # each `_known`, by its folded names
# The members of each object below the top level that the gateway (validation, the
# vision check, PII masking, tool-call pairing and governance, usage accounting, the
# Anthropic translation) or the official API reads: a message, a content part and its
# media object, a tool call and its function, a tool and its function, `tool_choice`,
# `response_format`, `stream_options`, `audio`, `prediction`.
_MESSAGE = _known(
    "role", "content", "name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio"
)
_PART = _known("type", "text", "image_url", "input_audio", "file", "refusal", "cache_control")
_MEDIA_MEMBERS: dict[str, frozenset[str]] = {
    "image_url": _known("url", "detail"),
    "input_audio": _known("data", "format"),
    "file": _known("file_data", "file_id", "filename"),
}
_CALL = _known("id", "type", "function")
_FUNCTION = _known("name", "arguments")  # a tool call's function
_TOOL = _known("type", "function")
_TOOL_FUNCTION = _known("name", "description", "parameters", "strict")
_CHOICE = _known("type", "function")
_CHOSEN = _known("name")
_FORMAT = _known("type", "json_schema")
_JSON_SCHEMA = _known("name", "description", "schema", "strict")
_STREAM_OPTIONS = _known("include_usage", "include_obfuscation", "continuous_usage_stats")
_AUDIO = _known("voice", "format")
_VOICE = _known("id")
_PREDICTION = _known("type", "content")
_TEXT_PART = _known("type", "text")


def case_variants(obj: dict[str, Any], known: frozenset[str], where: str) -> None:
    """400 naming a member of `obj` (the object at `where`) that is one of the `known`
    names (a `_known` set) spelt in other letters (`Role`, `Tool_Calls`, `Type`, a long
    s for an s): forwarded beside the member the gateway read, it is the one an
    upstream whose JSON decoder matches names without case may read (Go's
    `encoding/json`: the later of the two wins). The common object, whose members are
    all known, passes one subset check; a caller on a long path (a message, a tool
    call) makes that check itself (`known.issuperset(obj)`) and calls this only when
    it fails, so that the common object builds no `where`."""
    if known.issuperset(obj):
        return
    caseless = _CASELESS_OF[known]
    for name in obj:
        if name in known or (name.isascii() and name.islower()):
            continue
        _variant(name, caseless, where)


def _sampling(body: dict[str, Any], completion: bool = False) -> None:
    # Walk the fields the client sent (a handful) rather than every field we know; a
    # field sent as null counts as not sent.
    for name, v in body.items():
        if v is None:
            continue
        if completion and name == "logprobs":  # /v1/completions: an integer 0-5
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 5:
                raise InvalidRequest("'logprobs' must be an integer from 0 to 5", param=name)
            continue
        spec = _TYPED.get(name)
        if spec is not None:
            _typed(name, v, spec)
            continue
        check = _OTHER.get(name) or (None if completion else _CHAT_OTHER.get(name))
        if check is not None:
            check(body, v)
            continue
        why = ENGINE_NATIVE.get(name)
        if why is not None:
            raise InvalidRequest(f"'{name}' is {why}", param=name)
        case_variant(name)


def _typed(name: str, v: Any, spec: tuple[tuple[type[Any], ...], str]) -> None:
    """One typed field's rules (`_TYPED`, its bounds and lengths), whichever endpoint
    sends it: chat, completions, and the embeddings `user`."""
    types, what = spec
    # A bool is an int to isinstance: it passes only where a boolean is asked for.
    if (isinstance(v, bool) and bool not in types) or not isinstance(v, types):
        raise InvalidRequest(f"'{name}' must be {what}", param=name)
    if name in _AT_LEAST_1 and v < 1:
        raise InvalidRequest(f"'{name}' must be at least 1", param=name)
    bounds = _RANGES.get(name)
    if bounds is not None and not bounds[0] <= v <= bounds[1]:
        raise InvalidRequest(f"'{name}' must be between {bounds[0]} and {bounds[1]}", param=name)
    longest = _MAX_STRINGS.get(name)
    if longest is not None and len(v) > longest:
        raise InvalidRequest(f"'{name}' is longer than {longest} characters", param=name)
    if name == "user" and CONTROL.search(v):
        raise InvalidRequest(f"'{name}' may not hold control characters", param=name)


def _unknown(body: dict[str, Any], known: frozenset[str], policy: str) -> None:
    if policy == "reject":
        for name in body:
            if name not in known:
                raise InvalidRequest(
                    f"unknown field '{name}' (validation.unknown_fields: reject)", param=name
                )


def _part(i: int, j: int, part: Any) -> None:
    where = f"messages[{i}].content[{j}]"
    if isinstance(part, dict) and not _PART.issuperset(part):
        case_variants(part, _PART, where)
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(kind, str) or kind not in _PART_TYPES:  # a list: unhashable
        raise InvalidRequest(
            f"'{where}' must be a content part of type {sorted(_PART_TYPES)}", param=where
        )
    if kind == "text" and not isinstance(part.get("text"), str):
        raise InvalidRequest(f"'{where}.text' must be a string", param=f"{where}.text")
    if kind == "image_url":
        image = part.get("image_url")
        if not isinstance(image, dict) or not isinstance(image.get("url"), str) or not image["url"]:
            raise InvalidRequest(
                f"'{where}.image_url' must be an object with a 'url'", param=f"{where}.image_url"
            )
    elif kind == "input_audio":
        _input_audio(where, part.get("input_audio"))
    elif kind == "file":
        _file(where, part.get("file"))
    members = _MEDIA_MEMBERS.get(kind)
    if members is not None:  # a media part: its object, already checked an object
        case_variants(part[kind], members, f"{where}.{kind}")


# Base64 as the official API reads `input_audio.data`: the standard alphabet, padded.
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_AUDIO_IN = ("wav", "mp3")
MAX_FILE_ID = 128
MAX_FILENAME = 256


def _input_audio(where: str, audio: Any) -> None:
    where = f"{where}.input_audio"
    if not isinstance(audio, dict):
        raise InvalidRequest(f"'{where}' must be an object with 'data' and 'format'", param=where)
    data = audio.get("data")
    if not isinstance(data, str) or not data or len(data) % 4 or not _BASE64.fullmatch(data):
        raise InvalidRequest(
            f"'{where}.data' must be the audio as a base64 string", param=f"{where}.data"
        )
    if audio.get("format") not in _AUDIO_IN:
        raise InvalidRequest(f"'{where}.format' must be wav or mp3", param=f"{where}.format")


def _file(where: str, file: Any) -> None:
    where = f"{where}.file"
    if not isinstance(file, dict) or (
        file.get("file_data") is None and file.get("file_id") is None
    ):
        raise InvalidRequest(
            f"'{where}' must be an object with a 'file_data' or a 'file_id'", param=where
        )
    # The data is bounded by the body's size; it may be a data: URL (pii.py passes it
    # as media, never read).
    data = file.get("file_data", "-")
    if not isinstance(data, str) or not data:
        raise InvalidRequest(
            f"'{where}.file_data' must be a non-empty string", param=f"{where}.file_data"
        )
    for name, longest in (("file_id", MAX_FILE_ID), ("filename", MAX_FILENAME)):
        if name in file and not _short_string(file[name], longest):
            raise InvalidRequest(
                f"'{where}.{name}' must be a string of 1 to {longest} characters, without "
                "control characters",
                param=f"{where}.{name}",
            )


def _tool_calls(i: int, calls: Any) -> None:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise InvalidRequest(f"'{where}' must be an array", param=where)
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(call.get("id"), str)
            or not _NAME.fullmatch(str(fn.get("name", "")))
            or not isinstance(fn.get("arguments"), str)
        ):
            raise InvalidRequest(
                f"'{where}[{k}]' must have an 'id' and a 'function' with 'name' and "
                "'arguments' (a JSON string)",
                param=f"{where}[{k}]",
            )
        if not _CALL.issuperset(call):
            case_variants(call, _CALL, f"{where}[{k}]")
        if not _FUNCTION.issuperset(fn):
            case_variants(fn, _FUNCTION, f"{where}[{k}].function")


MAX_TOOLS = 128  # the OpenAI API's bound; each tool costs policy, PII and cache work


def tools_array(tools: Any) -> list[Any]:
    """A request's `tools` as an array of at most `MAX_TOOLS` whose names are distinct,
    whatever its protocol (chat completions, Responses, Messages: each codec's check
    starts here). Two tools of one name are a 400: a call naming it cannot say which
    schema it follows, and tool governance keys calls by name. A tool's name is
    `function.name` (chat) or `name` (Responses, Messages); each codec checks its
    characters after."""
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be an array", param="tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"'tools' may hold at most {MAX_TOOLS} tools", param="tools")
    seen: set[str] = set()
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict):
            continue  # the codec's own check names it
        fn = tool.get("function")
        chat = isinstance(fn, dict)
        name = (fn if isinstance(fn, dict) else tool).get("name")
        if isinstance(name, str):
            if name in seen:
                where = f"tools[{k}].function.name" if chat else f"tools[{k}].name"
                raise InvalidRequest(
                    f"'{where}': tool names must be unique; {name[:64]!r} is named twice",
                    param=where,
                )
            seen.add(name)
    return tools


def _tools(tools: Any) -> None:
    for k, tool in enumerate(tools_array(tools)):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise InvalidRequest(
                f"'tools[{k}]' must be {{'type': 'function', 'function': {{...}}}}",
                param=f"tools[{k}]",
            )
        if not _TOOL.issuperset(tool):
            case_variants(tool, _TOOL, f"tools[{k}]")
        if not _TOOL_FUNCTION.issuperset(fn):
            case_variants(fn, _TOOL_FUNCTION, f"tools[{k}].function")
        if not _NAME.fullmatch(str(fn.get("name", ""))):
            raise InvalidRequest(
                f"'tools[{k}].function.name' must be 1-64 of A-Z a-z 0-9 _ - .",
                param=f"tools[{k}].function.name",
            )
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequest(
                f"'tools[{k}].function.parameters' must be a JSON Schema object",
                param=f"tools[{k}].function.parameters",
            )


def image_parts(messages: list[dict[str, Any]] | None) -> str | None:
    """The first image part of a chat request's messages (its param path), or None."""
    for i, m in enumerate(messages or ()):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    return f"messages[{i}].content[{j}]"
    return None


def validate_chat(body: Any, unknown_fields: str = "pass") -> str:
    """Check a chat completion request; return its model name."""
    body = _require_object(body)
    model = _model(body)
    messages = body.get("messages")
    if messages is None:
        raise MissingRequiredParameter("you must provide a 'messages' parameter", param="messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    known = _MESSAGE.issuperset
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"'messages[{i}]' must be an object", param=f"messages[{i}]")
        if (len(m) > 2 or "content" not in m) and not known(m):
            # (the common message, a role and its content, skips the check)
            case_variants(m, _MESSAGE, f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:  # a list: unhashable
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
        if isinstance(content, list):
            for j, part in enumerate(content):
                _part(i, j, part)
        if len(m) > 2 or role == "tool":  # role + content, the common message: no more
            name = m.get("name")
            if name is not None and not (isinstance(name, str) and 0 < len(name) <= 256):
                raise InvalidRequest(
                    f"'messages[{i}].name' must be a string", param=f"messages[{i}].name"
                )
            if m.get("tool_calls") is not None:
                _tool_calls(i, m["tool_calls"])
            if role == "tool" and not isinstance(m.get("tool_call_id"), str):
                raise InvalidRequest(
                    f"'messages[{i}].tool_call_id' is required for role 'tool'",
                    param=f"messages[{i}].tool_call_id",
                )
    tools = body.get("tools")
    if tools is not None:
        _tools(tools)
    _sampling(body)
    if unknown_fields != "pass":
        _unknown(body, CHAT_FIELDS, unknown_fields)
    return model


def _token_list(v: Any) -> bool:
    return (
        isinstance(v, list)
        and bool(v)
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in v)
    )


def validate_completion(body: Any, unknown_fields: str = "pass") -> str:
    body = _require_object(body)
    model = _model(body)
    prompt = body.get("prompt")
    if prompt is None:
        raise MissingRequiredParameter("you must provide a 'prompt' parameter", param="prompt")
    if not (
        isinstance(prompt, str)
        or (
            isinstance(prompt, list)
            and prompt
            and (
                all(isinstance(p, str) for p in prompt)
                or _token_list(prompt)
                or all(_token_list(p) for p in prompt)
            )
        )
    ):
        raise InvalidRequest(
            "'prompt' must be a string, an array of strings, or token ids", param="prompt"
        )
    _sampling(body, completion=True)
    if unknown_fields != "pass":
        _unknown(body, COMPLETION_FIELDS, unknown_fields)
    return model


def validate_embeddings(
    body: Any, max_inputs: int, unknown_fields: str = "pass"
) -> tuple[str, list[str]]:
    """Check an embeddings request; return the model and the list of input texts."""
    body = _require_object(body)
    model = _model(body)
    inp = body.get("input")
    if inp is None:
        raise MissingRequiredParameter("you must provide an 'input' parameter", param="input")
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
    if not all(texts):  # as the OpenAI API: an empty text has nothing to embed
        where = "input" if isinstance(inp, str) else f"input[{texts.index('')}]"
        raise InvalidRequest(f"'{where}' must not be an empty string", param="input")
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ("float", "base64"):
        raise InvalidRequest(
            "'encoding_format' must be 'float' or 'base64'", param="encoding_format"
        )
    dims = body.get("dimensions")
    if dims is not None:
        _typed("dimensions", dims, _INT)
        if dims < 1:
            raise InvalidRequest("'dimensions' must be at least 1", param="dimensions")
    user = body.get("user")
    if user is not None:  # an end user's id, held to chat's and completions' rules
        _typed("user", user, _TYPED["user"])
    for name in body:
        case_variant(name)
    if unknown_fields != "pass":
        _unknown(body, EMBEDDING_FIELDS, unknown_fields)
    return model, texts


def model_refusal(ctx: RequestContext) -> InvalidRequest | None:
    """What the chosen model (`ctx.model`) cannot do that the request asks for: images,
    token ids, streaming (its `capabilities`)."""
    model = ctx.model
    assert model is not None
    req = ctx.generation
    if not model.capabilities.supports_vision and ctx.input.endpoint == "chat.completions":
        part = image_parts(req.messages)
        if part is not None:
            return InvalidRequest(
                f"the model '{model.alias}' does not accept images "
                "(capabilities.supports_vision is false)",
                param=part,
            )
    if req.return_token_ids is True:
        why = token_ids_refusal(model, ctx.stream, req.n)
        if why is not None:
            return InvalidRequest(f"the model '{model.alias}' {why}", param="return_token_ids")
    if ctx.stream and not model.capabilities.supports_streaming:
        return InvalidRequest(f"the model '{ctx.alias}' does not support streaming", param="stream")
    return None


def split_pin(
    name: str, models: Mapping[str, ModelConfig], rl_aliases: Container[str]
) -> tuple[str, str | None]:
    """(the alias, the pinned revision) of `alias@revision`. A pin needs an alias with
    several deployments (or an RL-managed one); on one with a single deployment only
    its own revision may be named (a no-op)."""
    alias, _, pin = name.partition("@")
    model = models.get(alias)
    if not pin or model is None:
        raise ModelNotFound(
            f"the model '{name[:128]}' does not exist; GET /v1/models lists the "
            "available ones (a revision is pinned as alias@revision)",
            param="model",
        )
    if model.deployments or alias in rl_aliases:
        return alias, pin
    if pin == model.revision:
        return alias, None
    raise ModelNotFound(
        f"the model '{alias}' has no revision '{pin[:64]}' (it is revision {model.revision!r})",
        param="model",
    )

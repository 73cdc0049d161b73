"""The internal request model: what each wire protocol's codec (api/codecs.py) decodes
a request into, what every stage reads, and what goes upstream.

Typed fields are the ones a stage reads; every other field the client sent is kept in
`extra`, in the order it came, and forwarded exactly as sent (engines take `top_k`,
`return_token_ids`, `logit_bias`, …; `validation.unknown_fields: reject` refuses
fields the gateway does not know before a request gets here). A request is never
changed in place: a stage that changes it replaces `ctx.request` with
`msgspec.structs.replace(...)`, so `ctx.wire` (the request decoded from the client's
bytes, and those bytes) still tells whether what goes upstream is what was sent.

At the bottom of the layering: it imports nothing of Switchyard.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec


class Generation(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A chat completion (`messages`) or a completion (`prompt`) request. Its fields
    hold what the client sent, shape-checked by the codec; None (or False) is not
    sent (a field sent as null counts as not sent)."""

    model: str
    messages: list[dict[str, Any]] | None = None  # chat: as sent, shape-checked
    prompt: str | list[Any] | None = None  # completions: a text, texts or token ids
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None  # chat: a boolean; completions: 0-5
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    functions: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    return_token_ids: bool | None = None  # vLLM's option (engines/token_ids.py)
    user: str | None = None
    prompt_cache_key: str | None = None
    # Every other field, as sent: forwarded, never read by a stage.
    extra: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def include_usage(self) -> bool:
        """Whether a stream's client asked for a final usage event."""
        so = self.stream_options
        return bool(so.get("include_usage")) if so else False

    @property
    def output_cap(self) -> int | None:
        """The output cap the client sent: the larger of max_tokens and
        max_completion_tokens when both are there (an engine honours one of them)."""
        a, b = self.max_tokens, self.max_completion_tokens
        if a is None:
            return b
        return a if b is None or a >= b else b


class Embedding(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An embeddings request; `texts` is `input` as a list."""

    model: str
    input: str | list[str]
    encoding_format: str | None = None
    dimensions: int | None = None
    user: str | None = None
    extra: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def texts(self) -> list[str]:
        inp = self.input
        return [inp] if isinstance(inp, str) else inp


Request = Generation | Embedding

# What the records (decisions, traces, usage rows) name a model there is none of: the
# client's name for it is free text (of any length, a pasted key at times); the client
# is told it back, the records are not.
UNKNOWN_MODEL = "(unknown model)"

# A context's request until its body is decoded (a refusal before that is settled
# with it); shared, so never changed (requests are replaced, not edited).
NOT_READ = Generation(model="")

GENERATION_FIELDS = frozenset(Generation.__struct_fields__) - {"extra"}
EMBEDDING_FIELDS = frozenset(Embedding.__struct_fields__) - {"extra"}
_FIELDS = {Generation: GENERATION_FIELDS, Embedding: EMBEDDING_FIELDS}


def from_object(
    kind: type[Generation] | type[Embedding],
    body: dict[str, Any],
    fields: frozenset[str] | None = None,
) -> tuple[Any, bool]:
    """(the typed request of a shape-checked JSON object, whether it holds every member
    of the object as sent). The fields a stage reads are set from it (one sent as null
    is left unset: then the request is not exact, and the client's bytes, which still
    name it, may not go upstream with members appended); every other member is kept
    in `extra` as it came. `fields` narrows the typed ones to those the protocol has
    checked (a member another protocol types stays in `extra`, never read, when this
    one does not check it)."""
    if fields is None:
        fields = _FIELDS[kind]
    known: dict[str, Any] = {}
    extra: dict[str, Any] | None = None
    exact = True
    for k, v in body.items():
        if k in fields:
            if v is not None:
                known[k] = v
            else:
                exact = False
        elif extra is None:
            extra = {k: v}
        else:
            extra[k] = v
    if extra is not None:
        known["extra"] = extra
    return kind(**known), exact


_encode = msgspec.json.Encoder().encode


def to_json(req: Request) -> bytes:
    """The request as one JSON object: its typed fields, then `extra`'s members. No key
    repeats: a member of `extra` named like a typed field (one its protocol does not
    check, `prompt` on a chat body) goes out only while that field is unset."""
    extra = req.extra
    if not extra:
        return _encode(req)
    shared = extra.keys() & _FIELDS[type(req)]
    if shared:
        extra = {k: v for k, v in extra.items() if k not in shared or getattr(req, k) is None}
    head = _encode(msgspec.structs.replace(req, extra={}))
    tail = _encode(extra)
    if len(tail) <= 2:
        return head
    return head[:-1] + b"," + tail[1:] if len(head) > 2 else tail


# -- integers no 64-bit integer holds ----------------------------------------------------
#
# The gateway's JSON parser (orjson) reads an integer literal as a 64-bit integer
# (-2^63 to 2^64 - 1) and any other as a float: 18446744073709551617 becomes
# 1.8446744073709552e19, which is 2^64. Every writer after it (PII masking, a
# protocol's translation, `to_json`) would send that float on, and on the client's
# own bytes the upstream would read another number than the one policy read. Such a
# literal is refused by name instead (api/body.py, engines/anthropic_request.py): kept
# whole, it could not be written by orjson at all (the ledger, the stores, the cache),
# and most upstreams' decoders (Go's, JavaScript's, a 64-bit field's) cannot hold it
# either. Float literals are not concerned: every writer writes the double it read.

_INT64 = 2**63
_UINT64 = 2**64
# orjson writes a float of 1e16 or more with an exponent (`1.8446744073709552e+19`):
# a float of 2^63 or more has one of 18 or more, and ends its number (a member's or
# an item's end, or the text's, follows). A text holding none holds no integer read
# as such a float.
_WIDE_WRITTEN = re.compile(rb"e\+(?:1[89]|[2-9][0-9]|[1-3][0-9][0-9])(?:[,\]}]|\Z)")
_LONGEST_KEY = 64  # characters of a member's name a path shows


def may_hold_wide_integer(written: bytes) -> bool:
    """Whether `written`, orjson's writing of a parsed JSON value, may hold an integer
    literal no 64-bit integer holds (read as a float); true for nearly no value (a
    float of 1e18 or more, or such text in a string, makes it true too). A text
    without a `+` (most: ~0.3 us for 20 KB, a memchr) is cleared by that alone; one
    with (base64 media, a `+` in text) is searched (~0.4 ns a byte)."""
    return b"+" in written and _WIDE_WRITTEN.search(written) is not None


class _Wide:
    __slots__ = ("literal",)

    def __init__(self, literal: str) -> None:
        self.literal = literal


def _exact_int(literal: str) -> int | _Wide:
    if len(literal) > 21:  # 2^64 has 20 digits; no longer literal is in range
        return _Wide(literal)
    value = int(literal)
    return value if -_INT64 <= value < _UINT64 else _Wide(literal)


def wide_integer(text: str | bytes) -> tuple[str, str] | None:
    """(where, literal) of the first integer literal in the JSON text `text` outside
    -2^63 to 2^64 - 1, or None: `where` is its path (`tools[0].function.parameters.
    maximum`; "" when the text is that number). `text` is JSON orjson has read. A
    second, exact parse (the standard library's, which reads integers whole): for the
    few texts `may_hold_wide_integer` cannot clear."""
    stack: list[tuple[str, Any]] = [("", json.loads(text, parse_int=_exact_int))]
    while stack:
        where, v = stack.pop()
        if isinstance(v, _Wide):
            return where, v.literal
        if isinstance(v, dict):
            stack.extend(
                (f"{where}.{k[:_LONGEST_KEY]}" if where else k[:_LONGEST_KEY], x)
                for k, x in reversed(v.items())
            )
        elif isinstance(v, list):
            stack.extend((f"{where}[{n}]", x) for n, x in reversed(list(enumerate(v))))
    return None

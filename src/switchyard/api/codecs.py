"""Protocol codecs: each wire protocol's request decoded once into the internal model
(request.py), which every stage reads, whatever protocol the request came in.

A codec is the only code that knows a protocol's request shape: it checks a parsed
JSON body against that shape (policy/validate.py holds the named checks and their
error messages) and returns the typed request. The internal reply is the chat
completions reply (and its stream events); today's three protocols are the OpenAI
ones, whose replies go out as the engines wrote them through the reply side. A new
protocol is a codec plus its tests: it decodes into `Generation` and turns the reply
(JSON or events) into its own shape at the HTTP boundary, touching no stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from switchyard.errors import InvalidRequest
from switchyard.policy.validate import validate_chat, validate_completion, validate_embeddings
from switchyard.request import GENERATION_FIELDS, Embedding, Generation, Request, from_object

# The typed fields each protocol checks: a chat body's `prompt` and a completion
# body's `messages`, `tools` and `functions` are not checked by theirs, so they stay
# in `extra` (forwarded as sent, read by no stage).
CHAT_TYPED = GENERATION_FIELDS - {"prompt"}
COMPLETION_TYPED = GENERATION_FIELDS - {"messages", "tools", "functions"}


class Codec(Protocol):
    """Decodes one protocol's requests: (the typed request, whether it is exactly the
    body as sent, so that the client's bytes may stand for it); raises the
    protocol-shaped 400 on a bad one."""

    def decode(self, body: Any) -> tuple[Request, bool]: ...


@dataclass(frozen=True, slots=True)
class GenerationCodec:
    """A protocol whose requests decode into `Generation`: its named checks, the
    typed fields they cover, and `validation.unknown_fields`."""

    check: Callable[[Any, str], str]  # raises the 400; returns the model name
    typed: frozenset[str]
    unknown_fields: str = "pass"
    # The deprecated `functions`/`function_call` refused: where tools are governed
    # (decide/stages.py refuses_legacy says where).
    no_legacy: bool = False

    def decode(self, body: Any) -> tuple[Generation, bool]:
        self.check(body, self.unknown_fields)
        if self.no_legacy and (
            body.get("functions") is not None or body.get("function_call") is not None
        ):
            raise InvalidRequest(
                "'functions' and 'function_call' are not accepted where tools are governed; "
                "send 'tools' and 'tool_choice'",
                param="functions" if body.get("functions") is not None else "function_call",
            )
        decoded: tuple[Generation, bool] = from_object(Generation, body, self.typed)
        return decoded


def chat_completions(unknown_fields: str = "pass", no_legacy: bool = False) -> GenerationCodec:
    """`POST /v1/chat/completions`."""
    return GenerationCodec(validate_chat, CHAT_TYPED, unknown_fields, no_legacy)


def completions(unknown_fields: str = "pass", no_legacy: bool = False) -> GenerationCodec:
    """`POST /v1/completions`."""
    return GenerationCodec(validate_completion, COMPLETION_TYPED, unknown_fields, no_legacy)


@dataclass(frozen=True, slots=True)
class Embeddings:
    """`POST /v1/embeddings`."""

    max_inputs: int  # embeddings.max_inputs
    unknown_fields: str = "pass"  # validation.unknown_fields

    def decode(self, body: Any) -> tuple[Embedding, bool]:
        validate_embeddings(body, self.max_inputs, self.unknown_fields)
        decoded: tuple[Embedding, bool] = from_object(Embedding, body)
        return decoded

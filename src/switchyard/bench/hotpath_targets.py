"""The hot-path bench's targets: what each driven Switchyard target turns on (auth and
the realistic key, tools, task headers, a tool-call reply), the client protocols each
protocol target speaks, and the deployments of the placement targets.

`hotpath.py` starts and drives them; this is only the table it reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from switchyard.bench.governed import REGISTRY, TASK_HEADERS
from switchyard.bench.harness import CHAT_PATH, chat_body
from switchyard.bench.protocols import messages_body, responses_body

# The targets: (auth and the realistic key, tools config, task headers, tool-call reply).
# gov-off and governed are bench/governed.py's sy-gov-off and sy-governed in process.
TARGETS: dict[str, tuple[bool, dict[str, Any] | None, dict[str, str], bool]] = {
    "switchyard": (False, None, {}, False),
    "realistic": (True, None, {}, False),
    "gov-off": (True, {"check_outputs": False}, {}, True),
    "governed": (True, {"registry": REGISTRY}, TASK_HEADERS, True),
    "balanced": (True, None, {}, False),
    "placed": (True, None, {}, False),
    "chat-stream": (True, None, {}, False),
    "responses": (True, None, {}, False),
    "responses-stream": (True, None, {}, False),
    "messages": (True, None, {}, False),
    "messages-stream": (True, None, {}, False),
}
# The protocols mode: the request of bench/protocols.py on each endpoint, streamed or
# not: (path, body, stream, what the reply must contain). `realistic` is its chat
# target without a stream.
PROTOCOLS: dict[str, tuple[str, Callable[[bool, int], bytes], bool, bytes | None]] = {
    "realistic": (CHAT_PATH, chat_body, False, None),
    "chat-stream": (CHAT_PATH, chat_body, True, b"data: [DONE]"),
    "responses": ("/v1/responses", responses_body, False, b'"status":"completed"'),
    "responses-stream": ("/v1/responses", responses_body, True, b"event: response.completed"),
    "messages": ("/v1/messages", messages_body, False, b'"type":"message"'),
    "messages-stream": ("/v1/messages", messages_body, True, b"event: message_stop"),
}
PROTOCOL_TARGETS = list(PROTOCOLS)
# Each protocol target's chat target of the same kind (streamed or not).
CHAT_OF = {t: "chat-stream" if spec[2] else "realistic" for t, spec in PROTOCOLS.items()}
# The placement mode: the realistic key on an alias of two deployments, balanced
# (least outstanding) without and with a placement policy between them.
_TWO = [
    {
        "name": "dev",
        "location": "device",
        "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"},
    },
    {
        "name": "cloud",
        "location": "cloud",
        "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"},
    },
]
MODELS: dict[str, dict[str, Any]] = {
    "balanced": {"deployments": _TWO, "balance": {"affinity": False}},
    "placed": {"deployments": _TWO, "balance": {"affinity": False}, "placement": {}},
}

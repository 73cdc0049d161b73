"""The embedding runtimes: ONNX Runtime (int8 or float32 export) and torch.

`load_backend` loads the one `embeddings.runtime` names, behind the `Backend`
interface the service (embed.py) runs: vectors and token counts for a batch of texts,
or for a lone text with every core. Texts are tokenised by the model folder's fast
tokenizer, truncated like sentence-transformers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from switchyard.config import EmbeddingsConfig
from switchyard.embed_export import INPUT_NAMES, cache_dir, exported_model
from switchyard.engines.assets import minilm_model_path


class Backend(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def dimensions(self) -> int: ...
    @property
    def model_file(self) -> str | None: ...
    @property
    def max_tokens(self) -> int:
        """The most tokens an input is read (and billed) as: longer ones are cut."""
        ...

    def encode(self, texts: list[str]) -> tuple[np.ndarray, list[int]]: ...

    def encode_lone(self, text: str) -> tuple[np.ndarray, list[int]]:
        """One text while nothing else runs: may use every core (same vector)."""
        ...


_KINDS = {"onnx-int8": "onnxruntime", "onnx": "onnxruntime", "torch": "sentence-transformers"}


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

    @property
    def max_tokens(self) -> int:
        return self.tokenize.max_length

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

    @property
    def max_tokens(self) -> int:
        return self.tokenize.max_length

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

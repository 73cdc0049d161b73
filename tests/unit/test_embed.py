"""The embedding service: ONNX runtimes against torch, batching, the export's disk cache.

Real model throughout. The ONNX export is cached under the default cache directory
(~/.cache/switchyard), so only the first run on a machine pays for it (~15 s).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from switchyard.config import EmbeddingsConfig
from switchyard.embed import (
    EXPORT_UNUSED_S,
    EmbeddingService,
    OnnxBackend,
    cache_dir,
    export_key,
    exported_model,
    prune_exports,
)
from switchyard.engines.assets import minilm_model_path
from switchyard.errors import EngineNotReady

Embed = Callable[[list[str]], Any]

TEXTS = [
    "How do I reset my password?",
    "What is the refund window for annual plans?",
    "Cancel my subscription, but not before the end of March.",
    "Transfer 250 EUR from my savings account to Alice.",
    "x",
    "Why was my card declined yesterday at the airport in Seoul? " * 24,
]


@pytest.fixture(scope="module")
def int8() -> EmbeddingService:
    return EmbeddingService(EmbeddingsConfig(runtime="onnx-int8")).load_blocking()


@pytest.fixture(scope="module")
def fp32() -> EmbeddingService:
    return EmbeddingService(EmbeddingsConfig(runtime="onnx")).load_blocking()


def _drive(
    cfg: EmbeddingsConfig,
    steps: Callable[[EmbeddingService], Awaitable[Any]],
    idle: Callable[[], bool] | None = None,
) -> Any:
    """Start a service on a loop, as the gateway does, run `steps` with it and stop it
    whatever happens; `steps`' result."""

    async def main() -> Any:
        svc = EmbeddingService(cfg, idle=idle)
        svc.start()
        while svc.state == "loading":
            await asyncio.sleep(0.01)
        assert svc.ready, svc.last_error
        try:
            return await steps(svc)
        finally:
            await svc.stop()

    return asyncio.run(main())


def test_onnx_vectors_match_torch(
    embed: Embed, int8: EmbeddingService, fp32: EmbeddingService
) -> None:
    ref = embed(TEXTS)
    for svc, bound in ((fp32, 0.9999), (int8, 0.98)):
        vecs, counts = svc.encode(TEXTS)
        assert vecs.shape == (len(TEXTS), 384) and vecs.dtype == np.float32
        assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
        cos = (vecs * ref).sum(axis=1)
        # Measured on the 913 texts of data/cache_pairs.jsonl: fp32 min 1.0000;
        # int8 min 0.983, mean 0.994.
        assert cos.min() >= bound, (svc.runtime, cos)
        assert counts[4] == 3  # [CLS] x [SEP]
        assert counts[5] == 256  # truncated like sentence-transformers
        d = svc.describe()
        assert d["runtime"] == svc.runtime and d["kind"] == "onnxruntime"
        assert d["dimensions"] == 384 and d["state"] == "ready"
        assert d["model_file"] and Path(d["model_file"]).exists()


def test_same_text_same_vector_alone_or_in_a_batch(
    int8: EmbeddingService, fp32: EmbeddingService
) -> None:
    alone = int8.encode([TEXTS[0]])[0][0]
    assert np.array_equal(alone, int8.encode([TEXTS[0]])[0][0])
    # The int8 graph runs each text alone, so its batch-mates cannot change it.
    assert np.array_equal(alone, int8.encode(TEXTS)[0][0])
    # float32 batches: padding changes the arithmetic only in the last bits.
    a, b = fp32.encode([TEXTS[0]])[0][0], fp32.encode(TEXTS)[0][0]
    assert float(a @ b) > 0.99999


def test_micro_batching_returns_each_caller_its_own_rows(int8: EmbeddingService) -> None:
    requests = [[f"question number {i}: {TEXTS[i % 4]}"] for i in range(12)]
    requests += [[TEXTS[1], TEXTS[2]], [TEXTS[5]]]

    async def steps(svc: EmbeddingService) -> tuple[list[Any], int, int]:
        await svc.embed(["warm"])  # idle: runs at once, alone
        idle_batches = svc.batches
        results = await asyncio.gather(*(svc.embed(r) for r in requests))
        return list(results), idle_batches, svc.batches - idle_batches

    results, idle_batches, batches = _drive(EmbeddingsConfig(runtime="onnx-int8"), steps)
    assert idle_batches == 1
    assert batches < len(requests)  # callers shared forward passes
    for texts, (vecs, counts) in zip(requests, results, strict=True):
        want, want_counts = int8.encode(texts)
        assert np.array_equal(vecs, want) and counts == want_counts


def test_idle_short_texts_are_embedded_inline_and_others_by_the_worker(
    int8: EmbeddingService,
) -> None:
    others = {"in_flight": 0}
    long_text = "word " * 80  # over inline_max_chars (256)

    async def steps(svc: EmbeddingService) -> dict[str, Any]:
        out: dict[str, Any] = {"idle": await svc.embed([TEXTS[0]])}
        out["after_idle"] = (svc.inline, svc.batches)
        out["long"] = await svc.embed([long_text])
        out["pair"] = await svc.embed(TEXTS[:2])
        out["after_long"] = (svc.inline, svc.batches)
        others["in_flight"] = 3
        out["busy"] = await svc.embed([TEXTS[0]])
        out["after_busy"] = (svc.inline, svc.batches)
        return out

    cfg = EmbeddingsConfig(runtime="onnx-int8", memo_entries=0)  # TEXTS[0] comes twice
    out = _drive(cfg, steps, idle=lambda: others["in_flight"] == 0)
    assert out["after_idle"] == (1, 0)  # no thread hop
    assert out["after_long"] == (1, 2)  # a long text or two texts: the worker
    assert out["after_busy"] == (1, 3)  # another request in flight: the worker
    want, counts = int8.encode([TEXTS[0]])
    for key in ("idle", "busy"):  # same vector whichever thread ran it
        assert np.array_equal(out[key][0], want) and out[key][1] == counts
    assert np.array_equal(out["long"][0], int8.encode([long_text])[0])


def test_a_repeated_single_text_is_answered_from_the_memo(int8: EmbeddingService) -> None:
    """The same single text again: the stored vector, no forward pass, read-only; the
    memo keeps only `memo_entries` texts (least recently used go first)."""

    async def steps(svc: EmbeddingService) -> dict[str, Any]:
        out: dict[str, Any] = {"first": await svc.embed_traced([TEXTS[0]])}
        out["again"] = await svc.embed_traced([TEXTS[0]])
        out["pair"] = await svc.embed_traced(TEXTS[:2])  # several texts: no memo
        await svc.embed([TEXTS[1]])
        await svc.embed([TEXTS[2]])  # evicts TEXTS[0] (memo of two)
        out["evicted"] = await svc.embed_traced([TEXTS[0]])
        out["counts"] = (svc.memo_hits, svc.inline)
        return out

    out = _drive(EmbeddingsConfig(runtime="onnx-int8", memo_entries=2), steps, lambda: True)
    want, counts = int8.encode([TEXTS[0]])
    assert out["first"][2] == "inline" and out["again"][2] == "memo"
    assert np.array_equal(out["again"][0], want) and out["again"][1] == counts
    assert not out["again"][0].flags.writeable  # shared: nobody may change it
    assert out["pair"][2] == "worker" and out["evicted"][2] == "inline"
    assert out["counts"] == (1, 4)


def test_the_memo_is_kept_per_tenant(int8: EmbeddingService) -> None:
    """A text one tenant embedded is embedded again for another (no memo answer whose
    speed would tell it what the first sent), and answered from the memo for the
    first tenant; the vectors are the same."""

    async def steps(svc: EmbeddingService) -> dict[str, Any]:
        out: dict[str, Any] = {"a": await svc.embed_traced([TEXTS[0]], "tenant-a")}
        out["b"] = await svc.embed_traced([TEXTS[0]], "tenant-b")
        out["a-again"] = await svc.embed_traced([TEXTS[0]], "tenant-a")
        return out

    out = _drive(EmbeddingsConfig(runtime="onnx-int8", memo_entries=8), steps, lambda: True)
    assert [out[k][2] for k in ("a", "b", "a-again")] == ["inline", "inline", "memo"]
    assert np.array_equal(out["a"][0], out["b"][0])


def test_the_lone_session_gives_the_same_vectors(int8: EmbeddingService) -> None:
    """An idle inline text runs in a session with every core; its threads split rows
    and columns, never a sum, so the vector is bit-identical to the shared session's."""
    backend = int8._backend
    assert isinstance(backend, OnnxBackend)
    if len(os.sched_getaffinity(0)) > 1:
        assert backend.lone is not backend.session
    for text in TEXTS:
        vecs, counts = backend.encode_lone(text)
        want, want_counts = int8.encode([text])
        assert np.array_equal(vecs, want) and counts == want_counts
    one = EmbeddingService(EmbeddingsConfig(runtime="onnx-int8", inline_threads=1))
    lone = one.load_blocking()._backend
    assert isinstance(lone, OnnxBackend) and lone.lone is lone.session


def test_export_is_cached_on_disk_and_reused(int8: EmbeddingService) -> None:
    first = Path(str(int8.describe()["model_file"]))
    before = first.stat()
    again = EmbeddingService(EmbeddingsConfig(runtime="onnx-int8")).load_blocking()
    second = Path(str(again.describe()["model_file"]))
    after = second.stat()
    assert second == first
    assert after.st_ino == before.st_ino  # not written again (exports are renamed in)
    assert after.st_mtime >= before.st_mtime  # but marked as used (see prune_exports)
    assert first.parent == cache_dir(EmbeddingsConfig())
    assert export_key(minilm_model_path()) in first.name


def test_concurrent_exports_write_once_and_atomically(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = minilm_model_path()
    got: list[str] = []
    errors: list[BaseException] = []

    def export() -> None:
        try:
            got.append(exported_model(path, False, tmp_path))
        except BaseException as exc:
            errors.append(exc)

    with caplog.at_level(logging.INFO, logger="switchyard.embed"):
        threads = [threading.Thread(target=export) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors and len(got) == 2 and got[0] == got[1]
    assert sum("exporting" in r.getMessage() for r in caplog.records) == 1
    assert not list(tmp_path.glob("*.tmp"))  # no half-written file left behind
    backend = OnnxBackend(path, got[0], max_batch=8, threads=1, lone_threads=1, per_text=False)
    assert backend.dimensions == 384


def test_unused_exports_of_other_keys_are_pruned_after_a_week(tmp_path: Path) -> None:
    now = 1_800_000_000.0
    week = EXPORT_UNUSED_S
    files = {
        "all-minilm-l6-v2-cur-int8.onnx": now - 2 * week,  # ours, however old: kept
        "all-minilm-l6-v2-cur.lock": now - 2 * week,
        "all-minilm-l6-v2-old-int8.onnx": now - week - 60,  # another key, unused: goes
        "all-minilm-l6-v2-old-fp32.onnx": now - week - 60,
        "all-minilm-l6-v2-old.lock": now - week - 60,  # locks stay (empty, maybe held)
        "all-minilm-l6-v2-new-int8.onnx": now - 60,  # another install, in use: kept
        "all-minilm-l6-v2-cur-int8.onnx.abc.tmp": now - week - 60,  # interrupted export
        "unrelated.onnx": now - 3 * week,  # not an export of ours
    }
    for name, mtime in files.items():
        f = tmp_path / name
        f.write_bytes(b"x")
        os.utime(f, (mtime, mtime))
    removed = prune_exports(tmp_path, "cur", now=now)
    assert sorted(removed) == [
        "all-minilm-l6-v2-cur-int8.onnx.abc.tmp",
        "all-minilm-l6-v2-old-fp32.onnx",
        "all-minilm-l6-v2-old-int8.onnx",
    ]
    left = sorted(f.name for f in tmp_path.iterdir())
    assert left == sorted(set(files) - set(removed))
    assert (tmp_path / "all-minilm-l6-v2-cur-int8.onnx").stat().st_mtime == now  # used now


def test_a_broken_onnx_file_fails_the_service_without_fallback(tmp_path: Path) -> None:
    cfg = EmbeddingsConfig(runtime="onnx-int8", cache_dir=str(tmp_path))
    key = export_key(minilm_model_path())
    (tmp_path / f"all-minilm-l6-v2-{key}-int8.onnx").write_bytes(b"not an onnx model")

    async def main() -> EmbeddingService:
        svc = EmbeddingService(cfg)
        svc.start()
        while svc.state == "loading":
            await asyncio.sleep(0.01)
        with pytest.raises(EngineNotReady):
            await svc.embed(["hello"])
        await svc.stop()
        return svc

    svc = asyncio.run(main())
    assert svc.last_error and "int8.onnx" in svc.last_error
    assert svc.describe()["runtime"] == "onnx-int8"
    with pytest.raises(Exception, match=r"int8\.onnx"):
        EmbeddingService(cfg).load_blocking()


def test_a_running_service_keeps_its_export_marked_in_use(int8: EmbeddingService) -> None:
    model_file = Path(str(int8.describe()["model_file"]))
    os.utime(model_file, (1_000_000, 1_000_000))  # as if unused for decades
    int8.mark_in_use()  # what the gateway's housekeeping loop calls every few minutes
    assert model_file.stat().st_mtime > 1_000_000

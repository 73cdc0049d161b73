"""Calibration of the semantic cache threshold on labelled prompt pairs.

A threshold is only meaningful against data: cosine similarity of all-MiniLM-L6-v2 puts
traps (negations, changed numbers, swapped names) as high as true paraphrases, so an
operator picks the threshold from the false-hit rate it buys, not from a round number.
`calibrate` scores every threshold with and without the hit verifier (a hit is served
only when similarity >= threshold and the verifier agrees), and `best_threshold` picks
the lowest threshold whose false-hit rate stays under a maximum: the lowest such
threshold serves the most paraphrases for that risk.

Pairs are JSON lines: {"a": str, "b": str, "same_answer": bool, "category": str?}: `a`
the earlier (cached) request, `b` the new one. The checks are called as the gateway
calls them: (new, cached), so `verifier(b, a)`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from switchyard.decide.labeled import read_jsonl
from switchyard.decide.verify import same_question

Pair = dict[str, Any]
Row = dict[str, Any]
Verifier = Callable[[str, str], tuple[bool, str]]
# The learned pair model's verdict, which also weighs the pair's cosine.
ModelVerifier = Callable[[str, str, float], tuple[bool, str]]
Embed = Callable[[list[str]], np.ndarray]

METRICS = ("tp", "fp", "fn", "tn", "precision", "recall", "f1", "false_hit_rate")


def load_pairs(path: str | Path) -> list[Pair]:
    """Read and check a JSONL file of labelled pairs; a bad line names its number."""
    return read_jsonl(path, {"a": str, "b": str, "same_answer": bool}, "pairs")


def load_set(spec: str | Path) -> list[Pair]:
    """One labelled set: a file, or files joined by '+' (read in order, as one set)."""
    return [p for path in str(spec).split("+") for p in load_pairs(path)]


def parse_thresholds(spec: str) -> list[float]:
    """ "0.5:0.99:0.01" (start:stop:step, stop included) or "0.8,0.85,0.9"."""
    if ":" not in spec:
        return sorted(float(x) for x in spec.split(","))
    start, stop, step = (float(x) for x in spec.split(":"))
    if step <= 0 or stop < start:
        raise ValueError(f"bad threshold range {spec!r}: want start:stop:step, start <= stop")
    count = round((stop - start) / step) + 1
    # Rounded so that 0.5 + 30 * 0.01 compares as 0.8, not 0.7999999.
    return [round(start + i * step, 6) for i in range(count) if start + i * step <= stop + 1e-9]


def similarities_for(pairs: Sequence[Pair], embed: Embed, batch_size: int = 256) -> list[float]:
    """Cosine similarity of a and b for each pair; each distinct text is embedded once."""
    texts = list(dict.fromkeys(t for p in pairs for t in (p["a"], p["b"])))
    vectors = np.concatenate(
        [
            np.asarray(embed(texts[i : i + batch_size]), dtype=np.float32)
            for i in range(0, len(texts), batch_size)
        ]
    )
    # Normalised again here: a caller's embed may not, and cosine needs unit vectors.
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    index = {t: i for i, t in enumerate(texts)}
    a = vectors[[index[p["a"]] for p in pairs]]
    b = vectors[[index[p["b"]] for p in pairs]]
    return [float(x) for x in np.einsum("ij,ij->i", a, b)]


def metrics(labels: Sequence[bool], predicted: Sequence[bool]) -> dict[str, float]:
    """Confusion counts and rates. No hit served at all counts as precision 1.0:
    nothing served, nothing wrong; recall (0) is what shows such a threshold is useless."""
    tp = sum(y and p for y, p in zip(labels, predicted, strict=True))
    fp = sum(p and not y for y, p in zip(labels, predicted, strict=True))
    fn = sum(y and not p for y, p in zip(labels, predicted, strict=True))
    tn = len(labels) - tp - fp - fn
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    negatives = fp + tn
    return {
        "tp": tp,
        "fp": fp,
        "fn": fn,
        "tn": tn,
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "false_hit_rate": fp / negatives if negatives else 0.0,
    }


def calibrate(
    pairs: Sequence[Pair],
    similarities: Sequence[float],
    thresholds: Sequence[float],
    verifier: Verifier | None = None,
    model: ModelVerifier | None = None,
) -> list[Row]:
    """One row per threshold without the verifier and, when given, one with it (and
    with the learned model too, when given: what the gateway serves).

    Each row: threshold, verifier (bool) and METRICS. A pair is a predicted hit when
    similarity >= threshold and (without verifier, or the verifier passes it)."""
    if len(pairs) != len(similarities):
        raise ValueError(f"{len(pairs)} pairs but {len(similarities)} similarities")
    labels = [bool(p["same_answer"]) for p in pairs]
    passes = (
        [
            verifier(p["b"], p["a"])[0] and (model is None or model(p["b"], p["a"], s)[0])
            for p, s in zip(pairs, similarities, strict=True)
        ]
        if verifier
        else None
    )
    # As the cache stage admits candidates: at or above the threshold, or below it
    # when they are the same question misspelt (decide/verify.py's same_question).
    same = [same_question(p["b"], p["a"]) for p in pairs] if verifier else [False] * len(pairs)
    rows: list[Row] = []
    for t in thresholds:
        above = [s >= t for s in similarities]
        rows.append({"threshold": t, "verifier": False, **metrics(labels, above)})
        if passes is not None:
            admitted = [x or q for x, q in zip(above, same, strict=True)]
            served = [x and ok for x, ok in zip(admitted, passes, strict=True)]
            rows.append({"threshold": t, "verifier": True, **metrics(labels, served)})
    return rows


def best_threshold(
    rows: Sequence[Row], max_false_hit_rate: float, verifier: bool | None = None
) -> float | None:
    """Lowest threshold whose false-hit rate is <= the maximum, or None if none is.

    `verifier` picks the rows with (True) or without (False) the verifier; by default
    the verified rows when there are any, since that is what the cache serves."""
    if verifier is None:
        verifier = any(r["verifier"] for r in rows)
    ok = [
        r["threshold"]
        for r in rows
        if r["verifier"] == verifier and r["false_hit_rate"] <= max_false_hit_rate
    ]
    return min(ok) if ok else None


def format_report(rows: Sequence[Row], max_false_hit_rate: float) -> str:
    """A plain-text table, without and with the verifier side by side, and the choice."""
    by_t: dict[float, dict[bool, Row]] = {}
    for r in rows:
        by_t.setdefault(r["threshold"], {})[r["verifier"]] = r
    sides = [v for v in (False, True) if any(v in d for d in by_t.values())]
    chosen = {v: best_threshold(rows, max_false_hit_rate, verifier=v) for v in sides}
    titles = " | ".join(f"{'with' if v else 'without'} verifier".center(_CELL_WIDTH) for v in sides)
    columns = " | ".join(_COLUMNS for _ in sides)
    lines = [f"{'':9s} | {titles}", f"threshold | {columns}"]
    for t in sorted(by_t):
        cells = [_cell(by_t[t].get(v), chosen[v] == t) for v in sides]
        lines.append(f"{t:9.3f} | " + " | ".join(cells))
    lines.append("")
    for v in sides:
        lines.append(_choice_line(rows, v, chosen[v], max_false_hit_rate))
    return "\n".join(lines)


_COLUMNS = "  precision recall    f1  false-hit  fp"
_CELL_WIDTH = len(_COLUMNS)


def _cell(row: Row | None, chosen: bool) -> str:
    if row is None:
        return " " * _CELL_WIDTH
    mark = "*" if chosen else " "
    return (
        f"{mark} {row['precision']:9.3f} {row['recall']:6.3f} {row['f1']:5.3f} "
        f"{row['false_hit_rate']:10.3f} {row['fp']:3d}"
    )


def _choice_line(
    rows: Sequence[Row], verifier: bool, chosen: float | None, max_false_hit_rate: float
) -> str:
    name = "with verifier" if verifier else "without verifier"
    if chosen is None:
        return f"{name}: no threshold keeps the false-hit rate <= {max_false_hit_rate:.2%}"
    row = next(r for r in rows if r["threshold"] == chosen and r["verifier"] == verifier)
    return (
        f"{name}: threshold {chosen:.3f} (lowest with false-hit rate <= "
        f"{max_false_hit_rate:.2%}): false-hit rate {row['false_hit_rate']:.2%}, "
        f"recall {row['recall']:.2%}, precision {row['precision']:.2%}, f1 {row['f1']:.3f}"
    )


def category_report(
    pairs: Sequence[Pair],
    similarities: Sequence[float],
    threshold: float | None,
    verifier: Verifier,
    field: str = "category",
    model: ModelVerifier | None = None,
) -> str:
    """Per category (or another field of the pairs, e.g. domain): how often the
    verifier vetoes, what is served at `threshold`, and the share that matters: of
    pairs that should hit, the share served (recall); of traps, the share kept out.

    Tells an operator which kind of trap still gets through, or which paraphrases the
    verifier refuses, rather than one aggregate number."""
    vetoed: Counter[str] = Counter()
    served: Counter[str] = Counter()
    total: Counter[str] = Counter()
    for pair, sim in zip(pairs, similarities, strict=True):
        cat = _category(pair, field)
        ok = verifier(pair["b"], pair["a"])[0] and (
            model is None or model(pair["b"], pair["a"], sim)[0]
        )
        total[cat] += 1
        vetoed[cat] += not ok
        admitted = threshold is not None and (
            sim >= threshold or same_question(pair["b"], pair["a"])
        )
        served[cat] += ok and admitted
    at = "-" if threshold is None else f"{threshold:.3f}"
    width = max([12, *(len(c) for c in total)])
    lines = [f"{field:{width}s} pairs  vetoed  served@{at}  kind  recall/kept out"]
    for cat in sorted(total):
        hits = [p for p in pairs if _category(p, field) == cat]
        should_hit = all(p["same_answer"] for p in hits)
        share = served[cat] / total[cat]
        kind, figure = ("hit", share) if should_hit else ("trap", 1 - share)
        if not should_hit and any(p["same_answer"] for p in hits):
            kind, figure = "mixed", share
        lines.append(
            f"{cat:{width}s} {total[cat]:5d}  {vetoed[cat] / total[cat]:6.1%}  "
            f"{served[cat]:{len(at) + 7}d}  {kind:5s} {figure:6.1%}"
        )
    return "\n".join(lines)


def _category(pair: Pair, field: str) -> str:
    label = "hit" if pair["same_answer"] else "trap"
    value = pair.get(field) or ("paraphrase" if pair["same_answer"] else "trap")
    return f"{value}/{label}" if field != "category" else str(value)


def _at(rows: Sequence[Row], threshold: float | None, what: str) -> str:
    """One line: the verified metrics at `threshold` (one of the rows' thresholds)."""
    row = next((r for r in rows if r["threshold"] == threshold and r["verifier"]), None)
    if row is None:
        return f"{what}: not among the thresholds scored"
    return (
        f"{what} {threshold:.3f} with the verifier: false-hit rate {row['false_hit_rate']:.2%} "
        f"({row['fp']} pairs), recall {row['recall']:.2%}, precision {row['precision']:.2%}"
    )


def run_calibration(
    paths: str | Sequence[str],
    thresholds: list[float],
    max_false_hit_rate: float,
    embed: Embed,
    verifier: Verifier | None = None,
    default_threshold: float | None = None,
    model: ModelVerifier | None = None,
) -> str:
    """The `switchyard cache calibrate` report, as printable text. The first file is
    the development set: it picks the threshold. Every later file is held out: it is
    reported at that threshold and at `default_threshold` (the shipped default), never
    used to choose anything."""
    if verifier is None:
        from switchyard.decide.verify import verify

        verifier = verify
    if isinstance(paths, str):
        paths = [paths]
    parts: list[str] = []
    dev_choice: float | None = None
    for i, path in enumerate(paths):
        pairs = load_set(path)
        sims = similarities_for(pairs, embed)
        rows = calibrate(pairs, sims, thresholds, verifier, model)
        positives = sum(bool(p["same_answer"]) for p in pairs)
        chosen = best_threshold(rows, max_false_hit_rate, verifier=True)
        role = "development set" if i == 0 else "held-out set"
        parts += [
            f"{path} ({role}): {len(pairs)} pairs ({positives} should hit, "
            f"{len(pairs) - positives} should not); cosine similarity, * marks the lowest "
            "threshold within the false-hit limit on this set",
            format_report(rows, max_false_hit_rate),
        ]
        if i == 0:
            dev_choice = chosen
        elif dev_choice is not None:
            parts.append(_at(rows, dev_choice, "at the development set's threshold"))
        if default_threshold is not None:
            parts.append(_at(rows, default_threshold, "at the shipped default threshold"))
        # Per category at the shipped default where there is one (what is served),
        # else at the development set's choice.
        at = default_threshold if default_threshold is not None else dev_choice
        parts.append(category_report(pairs, sims, at, verifier, model=model))
        if any("domain" in p for p in pairs):
            parts.append(category_report(pairs, sims, at, verifier, "domain", model))
    return "\n\n".join(parts)


def minilm_embed(batch_size: int = 64, runtime: str | None = None) -> Embed:
    """The gateway's embedding service (all-MiniLM-L6-v2 from its wheel), offline, on
    CPU, with the configured default runtime unless `runtime` names another one
    ("onnx-int8", "onnx", "torch"): calibrate with the runtime the gateway serves."""
    from switchyard.config import EmbeddingsConfig
    from switchyard.embed import EmbeddingService

    fields: dict[str, Any] = {"max_batch": batch_size}
    if runtime is not None:
        fields["runtime"] = runtime  # validated: an unknown runtime is a ConfigError-like
    cfg = EmbeddingsConfig.model_validate(fields)
    service = EmbeddingService(cfg).load_blocking()

    def embed(texts: list[str]) -> np.ndarray:
        return service.encode(texts)[0]

    return embed

"""Per-request records and the metrics computed from them (pure: no I/O, no clocks).

Tools disagree on what TTFT, TPOT and ITL mean, so every number here is derived from
timestamps the record keeps, and the definitions are written once, below and in
docs/benchmarks/index.md. All times in a record are seconds on one monotonic clock whose zero
is the start of the run; reported latencies are milliseconds.

* TTFT: `first_token_s - sent_s`, where `first_token_s` is the arrival of the first
  streamed event that carries content (role-only and empty events do not count).
* E2E: `end_s - sent_s`, the end being the arrival of the last byte of the response.
* TPOT: `(E2E - TTFT) / (output_tokens - 1)`; undefined for fewer than two tokens.
* ITL: the gaps between consecutive content-carrying events of one stream (events that
  arrived in the same network read share a timestamp, so a gap can be 0).
* Send lag (open loop): `sent_s - scheduled_s`, how late the harness sent a request.

Latency statistics use successful requests only; failures are counted by kind. Throughput
divides by the measurement window: from the first measured send to the last measured end.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES = (50, 90, 95, 99)


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request, as the harness saw it."""

    index: int
    request_id: str
    sent_s: float
    scheduled_s: float | None = None  # open loop only
    first_token_s: float | None = None
    end_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)  # arrival of content-carrying events
    ok: bool = False
    error: str | None = None  # a kind: http_503, timeout, connect, disconnect, ...
    error_detail: str | None = None
    error_code: str | None = None  # the error body's `code`, when it has one
    status: int | None = None
    warmup: bool = False
    max_tokens: int | None = None
    input_len: int | None = None  # the workload's target, when it has one
    input_tokens: int | None = None
    output_tokens: int | None = None
    token_source: str | None = None  # "server" (usage) or "tokenizer"
    task_id: str | None = None
    step_id: str | None = None
    parent_request_ids: list[str] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    prompt_text: str = ""  # kept in memory for token counting; not written out
    text: str = ""

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_s is None:
            return None
        return (self.first_token_s - self.sent_s) * 1000

    @property
    def e2e_ms(self) -> float | None:
        return None if self.end_s is None else (self.end_s - self.sent_s) * 1000

    @property
    def tpot_ms(self) -> float | None:
        ttft, e2e, n = self.ttft_ms, self.e2e_ms, self.output_tokens
        if ttft is None or e2e is None or n is None or n < 2:
            return None
        return (e2e - ttft) / (n - 1)

    @property
    def itl_ms(self) -> list[float]:
        c = self.chunk_s
        return [(b - a) * 1000 for a, b in itertools.pairwise(c)]

    @property
    def lag_ms(self) -> float | None:
        return None if self.scheduled_s is None else (self.sent_s - self.scheduled_s) * 1000

    def to_json(self) -> dict[str, Any]:
        """The stored form: raw timestamps plus the derived values, texts left out."""
        # Field by field: dataclasses.asdict deep-copies and costs ~0.5 ms per record.
        d = {f: getattr(self, f) for f in self.__slots__ if f not in ("prompt_text", "text")}
        d["output_chars"] = len(self.text)
        d.update(ttft_ms=self.ttft_ms, e2e_ms=self.e2e_ms, tpot_ms=self.tpot_ms, lag_ms=self.lag_ms)
        return d


@dataclass(frozen=True, slots=True)
class Slo:
    """Goodput thresholds in ms; `None` means no limit on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    task_ms: float | None = None  # agent tasks: task E2E

    def met(self, r: RequestRecord) -> bool:
        """All given request SLOs met. A success without content has no TTFT, so it misses
        a TTFT SLO; one with fewer than two tokens has no decode phase and passes TPOT."""
        if not r.ok:
            return False
        checks = ((self.ttft_ms, r.ttft_ms), (self.e2e_ms, r.e2e_ms))
        for limit, value in checks:
            if limit is not None and (value is None or value > limit):
                return False
        tpot = r.tpot_ms
        return self.tpot_ms is None or tpot is None or tpot <= self.tpot_ms

    def as_dict(self) -> dict[str, float | None]:
        return asdict(self)


def parse_slo(parts: Iterable[str]) -> Slo:
    """`["ttft:500", "tpot:50,e2e:2000"]` -> Slo (`e2el` as in vLLM bench is accepted).
    Raises ValueError on unknown names."""
    values: dict[str, float] = {}
    for part in (p for chunk in parts for p in chunk.replace(",", " ").split()):
        name, _, ms = part.partition(":")
        name = "e2e" if name == "e2el" else name  # vLLM bench's spelling
        if name not in ("ttft", "tpot", "e2e", "task") or not ms:
            raise ValueError(f"goodput {part!r}: use ttft:MS, tpot:MS, e2e:MS or task:MS")
        try:
            values[f"{name}_ms"] = float(ms)
        except ValueError:
            raise ValueError(f"goodput {part!r}: {ms!r} is not a number of ms") from None
    return Slo(**values)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, as vLLM bench uses)."""
    if not values:
        raise ValueError("percentile of no values")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def stats(values: Sequence[float]) -> dict[str, float | int | None]:
    """n, mean, p50/p90/p95/p99, max (and min), or Nones with n=0."""
    out: dict[str, float | int | None] = {"n": len(values)}
    keys = ["mean", "min", *(f"p{q}" for q in PERCENTILES), "max"]
    if not values:
        return out | dict.fromkeys(keys)
    out["mean"] = sum(values) / len(values)
    out["min"] = min(values)
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q)
    out["max"] = max(values)
    return out


def _window(records: Sequence[RequestRecord]) -> float:
    ends = [r.end_s for r in records if r.end_s is not None]
    if not records or not ends:
        return 0.0
    return max(ends) - min(r.sent_s for r in records)


def summarize(
    records: Sequence[RequestRecord], slo: Slo, window_s: float | None = None
) -> dict[str, Any]:
    """The request-level summary of one load point. Warm-up records are left out;
    `window_s` overrides the measurement window (agent runs pass the tasks' window)."""
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    duration = _window(measured) if window_s is None else window_s
    good = sum(1 for r in ok if slo.met(r))
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    in_tokens = sum(r.input_tokens or 0 for r in ok)

    def rate(x: float) -> float | None:
        return x / duration if duration > 0 else None

    def collect(attr: str) -> list[float]:
        return [v for r in ok if (v := getattr(r, attr)) is not None]

    return {
        "requests": len(measured),
        "warmup_requests": len(records) - len(measured),
        "completed": len(ok),
        "failed": len(measured) - len(ok),
        "error_rate": (len(measured) - len(ok)) / len(measured) if measured else 0.0,
        "errors": dict(sorted(Counter(r.error or "unknown" for r in measured if not r.ok).items())),
        "duration_s": duration,
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(out_tokens),
        "total_token_throughput": rate(out_tokens + in_tokens),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "good_requests": good,
        "goodput": rate(good),
        "ttft_ms": stats(collect("ttft_ms")),
        "tpot_ms": stats(collect("tpot_ms")),
        "itl_ms": stats([g for r in ok for g in r.itl_ms]),
        "e2e_ms": stats(collect("e2e_ms")),
        "send_lag_ms": stats([v for r in measured if (v := r.lag_ms) is not None]),
        "token_source": dict(Counter(r.token_source or "none" for r in ok)),
        **_media_split(ok),
    }


def server_timing(value: str) -> dict[str, float]:
    """`Server-Timing: name;dur=1.2, ...` as {name: ms}."""
    out: dict[str, float] = {}
    for item in value.split(","):
        name, _, rest = item.strip().partition(";")
        for param in rest.split(";"):
            key, _, dur = param.strip().partition("=")
            if key == "dur":
                with contextlib.suppress(ValueError):  # a malformed entry is left out
                    out[name.strip()] = float(dur)
    return out


def _media_split(ok: Sequence[RequestRecord]) -> dict[str, Any]:
    """The media stage's time per step (from Server-Timing), when requests had images:
    TTFT split into fetch, decode, resize, encode and the rest."""
    steps: dict[str, list[float]] = {}
    for r in ok:
        timing = r.headers.get("server-timing")
        if not timing:
            continue
        for name, ms in server_timing(timing).items():
            if name.startswith("media_"):
                steps.setdefault(name.removeprefix("media_"), []).append(ms)
    return {"media_ms": {k: stats(v) for k, v in sorted(steps.items())}} if steps else {}

"""Batching finished requests' updates before they reach prometheus_client.

prometheus_client takes a lock per label lookup, per bucket and per sum on every
update. `Metrics` (metrics.py) therefore gathers what finished since the last fold
here: label children kept once created, counter increments summed per request shape,
histogram values observed as one update per touched bucket, and the common request's
values appended to its shape's lists.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any, Protocol


class _Children:
    """A metric's label children, kept once created: `labels()` validates and locks on
    every call, and label sets here are bounded, so the lookup is a dict hit."""

    __slots__ = ("_kids", "_metric")

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._kids: dict[tuple[str, ...], Any] = {}

    def __call__(self, *labels: str) -> Any:
        kid = self._kids.get(labels)
        if kid is None:
            kid = self._kids[labels] = self._metric.labels(*labels)
        return kid


def observe_many(child: Any, values: list[float]) -> None:
    """`child.observe(v)` for each value, as one update per touched bucket and one for
    the sum: prometheus_client takes a lock per bucket and per sum on every observe.
    Falls back to observing one by one if the histogram's layout is not the one this
    was written against (prometheus_client 0.2x)."""
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            child.observe(v)
        return
    counts = [0] * len(bounds)
    summed = 0.0
    for v in values:
        if v != v:  # NaN: observe() counts it in no bucket
            continue
        counts[bisect_left(bounds, v)] += 1  # the first bound >= v, as observe() picks
        summed += v
    total.inc(summed)
    for i, n in enumerate(counts):
        if n:
            buckets[i].inc(n)


Shape = tuple[tuple["_Children", tuple[str, ...]], ...]  # a request's counter increments


class _Batch:
    """One fold's updates, summed per label child before any reaches prometheus_client:
    a fold holds every request that finished in the last `fold_s`, and most of them
    share their labels. Counter increments are grouped by request shape: requests
    whose counters move alike (same labels, same attempts) share one tuple of
    increments, counted once per shape and applied once per fold."""

    __slots__ = ("counts", "shapes", "values")

    def __init__(self) -> None:
        self.counts: dict[tuple[_Children, tuple[str, ...]], float] = {}
        self.shapes: dict[Shape, int] = {}
        self.values: dict[tuple[_Children, tuple[str, ...]], list[float]] = {}

    def inc(self, kids: _Children, labels: tuple[str, ...], n: float = 1.0) -> None:
        key = (kids, labels)
        self.counts[key] = self.counts.get(key, 0.0) + n

    def shape(self, incs: Shape) -> None:
        """Count one request whose counters each go up by one: `incs` lists them."""
        self.shapes[incs] = self.shapes.get(incs, 0) + 1

    def observe(self, kids: _Children, labels: tuple[str, ...], v: float) -> None:
        key = (kids, labels)
        got = self.values.get(key)
        if got is None:
            self.values[key] = [v]
        else:
            got.append(v)

    def apply(self) -> None:
        counts = self.counts
        for incs, n in self.shapes.items():
            for key in incs:
                counts[key] = counts.get(key, 0.0) + n
        for (kids, labels), total in counts.items():
            kids(*labels).inc(total)
        for (kids, labels), values in self.values.items():
            observe_many(kids(*labels), values)


class _Families(Protocol):
    """The label children a `_Common` folds into (metrics.Metrics has them)."""

    _e2e: _Children
    _ttft: _Children
    _queue: _Children
    _itl: _Children
    _tokens: _Children
    _cost: _Children


class _Common:
    """What the requests of one first-attempt shape (same model, tenant, route and
    cache result) added since the last fold: observed by appending to lists, with no
    per-request tuple, key or lookup beyond the shape's own."""

    __slots__ = (
        "cost",
        "e2e",
        "inp",
        "itl",
        "model",
        "n",
        "out",
        "queue",
        "shape",
        "tenant",
        "ttft",
    )

    def __init__(self, shape: Shape, model: str, tenant: tuple[str, ...]) -> None:
        self.shape, self.model, self.tenant = shape, model, tenant
        self.n = self.inp = self.out = 0
        self.cost = 0.0
        self.e2e: list[float] = []
        self.ttft: list[float] = []
        self.queue: list[float] = []
        self.itl: list[float] = []

    def fold_into(self, b: _Batch, m: _Families) -> None:
        """Add to the batch what a request-by-request `_observe` would have."""
        model, n = (self.model,), self.n
        b.shapes[self.shape] = b.shapes.get(self.shape, 0) + n
        for kids, values in ((m._e2e, self.e2e), (m._ttft, self.ttft), (m._queue, self.queue)):
            if values:
                b.values.setdefault((kids, model), []).extend(values)
        if self.itl:
            b.values.setdefault((m._itl, model), []).extend(self.itl)
        if self.inp:
            b.inc(m._tokens, (self.model, "input"), self.inp)
        if self.out:
            b.inc(m._tokens, (self.model, "output"), self.out)
        if self.cost:
            b.inc(m._cost, (self.model, *self.tenant), self.cost)
        self.n = self.inp = self.out = 0
        self.cost = 0.0
        self.e2e, self.ttft, self.queue, self.itl = [], [], [], []

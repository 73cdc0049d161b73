"""Which of an alias's deployments serves a request (models[].deployments).

Eligible deployments are those that can take the request now: ready (or loadable by
the pool), not failed, breaker not open (checked without taking a half-open probe:
the executor takes it), below their `max_in_flight`, with a positive weight, and
inside the tenant's regions and the model's data boundary. Among them:

- `weighted`: random by weight;
- `least_outstanding`: two weighted random picks, the one with fewer requests in
  flight (power of two choices, as Ray Serve's and LiteLLM's least-busy routers);
- `latency`: the lowest EWMA of time to first token plus per-token time for the
  request's expected tokens; a deployment never measured, or not for `stale_s`, is
  tried first, and a `probe` share goes to a random other one, so a deployment that
  recovered is measured again.

Affinity: a request of an agent task (x-task-id, per tenant) or a session
(prompt_cache_key, x-session-id, or `user`) goes where the task's previous request
went while that deployment is eligible and not loaded past `affinity_load_factor` x
the average in flight; when it yields, the decision says why. Otherwise a request
with a long prompt goes to its prefix's deployment on a hash ring (consistent hashing
with the same load bound: the next one clockwise when it is full), so requests
sharing a prefix find it in that engine's cache.

When no deployment is eligible the first (inside the regions, when one is) is chosen
with every reason recorded, and the executor refuses it (not ready, circuit open), so
the model's fallbacks apply. A model none of whose deployments is inside the tenant's
regions never gets here: the select stage refuses it (decide/stages_select.py).

The canary guard judges a canary's window of outcomes (`guard_check`, kept as counts:
state/guard.py). With a `guard_share` (several gateway processes, `storage.redis_url`:
state/guard_redis.py) it judges over every process's window: its own with the others'
counts as last shared, at each outcome here and at each exchange (`guard_adopt`), where
a cut is reported through `on_cut` as the request path's would be.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

from switchyard.config import BalanceConfig, CanaryGuard
from switchyard.engines.registry import Deployment
from switchyard.errors import ModelNotFound
from switchyard.request import Generation
from switchyard.state.breakers_memory import CircuitBreaker
from switchyard.state.guard import NONE, GuardCounts, GuardShare
from switchyard.state.weights import canary_weights

# What a cut that left no deployment any weight adds to its reason (control/weights.py
# then stores the rollback's weights for every process).
ROLLED_BACK = "no deployment had weight left: rolled back to the configured weights"

_KEY_CHARS = 256  # an affinity key longer than this is kept as its hash
PIN_CHARS = 64  # of a pin, quoted in a refusal (as policy/validate.py `split_pin`)
RING_POINTS = 64  # points per deployment on the prefix hash ring


class Balancer:
    def __init__(
        self,
        alias: str,
        deployments: list[Deployment],
        cfg: BalanceConfig,
        breakers: Mapping[str, CircuitBreaker],
        rng: random.Random | None = None,
        guard_share: GuardShare | None = None,
        on_cut: Callable[[str, Deployment, str], None] | None = None,
    ) -> None:
        self.alias = alias
        self.deployments = deployments
        self.cfg = cfg
        self._breakers = breakers
        self.rng = rng or random.Random()
        self._affinity: OrderedDict[tuple[str, str, str], Deployment] = OrderedDict()
        self._by_name = {d.name: d for d in deployments}
        # Per deployment, read on every request: (it, its max_in_flight, its breaker).
        self._rows = [
            (d, d.replica.max_in_flight if d.replica is not None else None, breakers.get(d.name))
            for d in deployments
        ]
        # Deployments of more than one revision: a task never mixes them (its affinity
        # does not yield to load), and weights are canary weights.
        self.versioned = len({d.model.revision for d in deployments}) > 1
        self.guard: CanaryGuard | None = deployments[0].model.canary_guard if deployments else None
        # The guard's window of each canary (d.live.outcomes) as running counts
        # [n, errors, good, slow], the other processes' counts as last shared (empty
        # when alone), and (alias, deployment, why) for a cut judged at an exchange.
        self._counts: dict[str, list[int]] = {}
        self._others: Mapping[str, GuardCounts] = {}
        self._share = guard_share if self.guard is not None and self.canaries() else None
        self._on_cut = on_cut
        if self.guard is not None:
            for d in self.canaries():
                counts = self._counts[d.name] = [0, 0, 0, 0]
                for outcome in d.live.outcomes:
                    _count(counts, outcome, self.guard.max_p95_ms, 1)
        if self._share is not None:
            self._share.watch(self)
        # The hash ring for prefix affinity: RING_POINTS points per deployment, by name
        # (so a restart or another gateway builds the same ring).
        ring = [
            (_hash(f"{d.name}#{i}".encode()), d) for d in deployments for i in range(RING_POINTS)
        ]
        ring.sort(key=lambda p: p[0])
        self._ring_points = [p for p, _ in ring]
        self._ring = [d for _, d in ring]

    # -- one request -------------------------------------------------------------
    def choose(
        self,
        *,
        tenant: str | None = None,
        affinity: tuple[str, str] | None = None,
        prefix: str | None = None,
        pin: str | None = None,
        regions: list[str] | None = None,
        tokens: int = 256,
        now: float | None = None,
        remembered: str | None = None,
        location: str | None = None,
        only: str | None = None,
    ) -> tuple[Deployment, str, dict[str, Any]]:
        """(the deployment, why it won, the evidence: every candidate with its state).
        `remembered` is the deployment the task store holds for this request's task
        (every gateway process's record): it wins over this process's own map.
        `location` (placement's choice) keeps only the deployments there; `only`
        (placement's degraded deployment) keeps that one."""
        now = time.monotonic() if now is None else now
        states: dict[str, dict[str, Any]] = {}
        eligible: list[Deployment] = []
        for d, cap, breaker in self._rows:
            live = d.live
            state: dict[str, Any] = {
                "in_flight": live.in_flight,
                "ewma_ttft_ms": live.ttft_ms,
                "ewma_tpot_ms": live.tpot_ms,
                "weight": live.weight,
                "breaker": breaker.state if breaker is not None else None,
            }
            engine = live.engine_now(now)
            if engine is not None:  # what the engine itself says (all its clients)
                state["engine"] = engine.evidence()
            states[d.name] = state
            why = self._ineligible(d, 1.0 if pin else live.weight, cap, breaker, regions, now)
            if why is None and location is not None and d.location != location:
                why = f"placed on the {location}, it runs on the {d.location}"
            if why is None and only is not None and d.name != only:
                why = f"placement degraded to {only}"
            if why is None:
                eligible.append(d)
            else:
                state["skipped"] = why
        evidence: dict[str, Any] = {"strategy": self.cfg.strategy, "candidates": states}
        if pin is not None:
            return self._pinned(pin, eligible, evidence, regions)
        if not eligible:  # the first at the location and inside the regions, if any is
            at = [
                d
                for d in self.deployments
                if (location is None or d.location == location)
                and (regions is None or d.model.region in regions)
            ]
            chosen = at[0] if at else self.deployments[0]
            reason = (
                "no deployment is eligible: sent to the first, whose refusal lets fallbacks apply"
            )
            return self._take(chosen, None, reason, evidence)
        key = None
        if self.cfg.affinity and affinity is not None:
            kind, value = affinity
            key = (tenant or "", kind, _bounded(value))
            kept = self._affinity.get(key)
            if remembered is not None and (kept is None or kept.name != remembered):
                kept = self._by_name.get(remembered, kept)
                if kept is not None:
                    self._affinity[key] = kept  # this process learns the shared record
            if kept is not None:
                self._affinity.move_to_end(key)
                yielded = self._yield_reason(kept, eligible, states)
                if yielded is None:
                    evidence["affinity"] = {"kind": kind, "outcome": "kept"}
                    return self._take(kept, None, f"affinity: the {kind}'s deployment", evidence)
                evidence["affinity"] = {
                    "kind": kind,
                    "outcome": "yielded",
                    "from": kept.name,
                    "why": yielded,
                }
                if self.versioned:
                    evidence["affinity"]["revision"] = kept.model.revision
        kept_rev = evidence.get("affinity", {}).get("revision")
        same = [d for d in eligible if d.model.revision == kept_rev] if kept_rev else []
        if same:  # a task whose deployment left: another of its revision if there is one
            chosen, reason = self._pick(same, tokens, now)
            reason = f"affinity: another deployment of the task's revision ({reason})"
        elif prefix is not None and self.cfg.prefix_affinity:
            chosen, how = self._ring_pick(prefix, eligible)
            evidence["prefix_affinity"] = how
            reason = f"prefix affinity: the prompt prefix's deployment on the hash ring ({how})"
        else:
            chosen, reason = self._pick(eligible, tokens, now)
        if key is not None:
            evidence.setdefault("affinity", {"kind": key[1], "outcome": "new"})
            self._affinity[key] = chosen
            self._affinity.move_to_end(key)
            while len(self._affinity) > self.cfg.affinity_entries:
                self._affinity.popitem(last=False)
        return self._take(chosen, key, reason, evidence)

    def failover(
        self,
        tried: set[str],
        *,
        revision: str | None = None,
        regions: list[str] | None = None,
        tokens: int = 256,
        now: float | None = None,
        location: str | None = None,
    ) -> tuple[Deployment, str, dict[str, Any]] | None:
        """Another eligible deployment, not one in `tried` (by name) and of `revision`
        when given, picked by the strategy (no affinity: the one it had just failed);
        None when there is none. The pick is in flight until settled, as choose's."""
        now = time.monotonic() if now is None else now
        skipped: dict[str, str] = {}
        eligible: list[Deployment] = []
        for d, cap, breaker in self._rows:
            if d.name in tried:
                continue
            why = (
                f"revision {d.model.revision}, not the request's {revision}"
                if revision is not None and d.model.revision != revision
                else f"placed on the {location}"
                if location is not None and d.location != location
                else self._ineligible(d, d.live.weight, cap, breaker, regions, now)
            )
            if why is None:
                eligible.append(d)
            else:
                skipped[d.name] = why
        if not eligible:
            return None
        chosen, reason = self._pick(eligible, tokens, now)
        evidence: dict[str, Any] = {"strategy": self.cfg.strategy, "tried": sorted(tried)}
        if skipped:
            evidence["skipped"] = skipped
        return self._take(chosen, None, reason, evidence)

    def eligible(
        self, regions: list[str] | None = None, now: float | None = None
    ) -> list[Deployment]:
        """The deployments that could take a request now (choose's filter, no pick)."""
        now = time.monotonic() if now is None else now
        return [
            d
            for d, cap, breaker in self._rows
            if self._ineligible(d, d.live.weight, cap, breaker, regions, now) is None
        ]

    def pinned(self, pin: str, regions: Collection[str] | None = None) -> list[Deployment]:
        """The deployments a pin names (`alias@revision`, or a deployment's name); an
        unknown one is 404 `model_not_found`, quoting at most 64 characters of it and
        naming the revisions the caller may reach (inside `regions`, when it has some:
        one outside them is not the caller's to know of)."""
        match = [
            d
            for d in self.deployments
            if d.model.revision == pin or (d.replica is not None and d.replica.name == pin)
        ]
        if not match:
            known = sorted(
                {
                    d.model.revision
                    for d in self.deployments
                    if regions is None or d.model.region in regions
                }
            )
            raise ModelNotFound(
                f"the model '{self.alias}' has no revision '{pin[:PIN_CHARS]}'"
                f"{'...' if len(pin) > PIN_CHARS else ''} (it has: {', '.join(known)})",
                param="model",
            )
        return match

    def _pinned(
        self,
        pin: str,
        eligible: list[Deployment],
        evidence: dict[str, Any],
        regions: list[str] | None = None,
    ) -> tuple[Deployment, str, dict[str, Any]]:
        """The client named the revision: an eligible deployment of it, else one inside
        the regions (refused by the executor as not ready, not as outside them)."""
        match = self.pinned(pin, regions)
        ok = [d for d in match if any(d is e for e in eligible)]
        inside = [d for d in match if regions is None or d.model.region in regions]
        chosen = min(ok or inside or match, key=lambda d: d.live.in_flight)
        evidence["pin"] = pin
        why = f"pinned by the client to revision {chosen.model.revision}"
        if not ok:
            why += ": no deployment of it is eligible, so the executor refuses it"
        return self._take(chosen, None, why, evidence)

    def _take(
        self, d: Deployment, key: Any, reason: str, evidence: dict[str, Any]
    ) -> tuple[Deployment, str, dict[str, Any]]:
        d.live.in_flight += 1
        d.live.selected += 1
        evidence["chosen"] = d.name
        return d, reason, evidence

    @staticmethod
    def _ineligible(
        d: Deployment,
        weight: float,
        cap: int | None,
        breaker: CircuitBreaker | None,
        regions: list[str] | None,
        now: float,
    ) -> str | None:
        if weight <= 0:
            return "weight 0"
        engine = d.engine
        if engine is not None:
            if engine.failed:
                return "engine failed"
            if not (d.ready or d.loadable):
                return f"not ready (engine {engine.state.value})"
        if breaker is not None and breaker.state != "closed":
            why = breaker.refusal(now)
            if why is not None:
                return why
        if cap is not None and d.live.in_flight >= cap:
            return f"full ({d.live.in_flight} in flight, max_in_flight {cap})"
        if regions is not None and d.model.region not in regions:
            return f"region {d.model.region!r} is outside the allowed {regions}"
        return None

    def _yield_reason(
        self, kept: Deployment, eligible: list[Deployment], states: dict[str, dict[str, Any]]
    ) -> str | None:
        if not any(d is kept for d in eligible):  # identity: == compares whole configs
            return str(states.get(kept.name, {}).get("skipped", "no longer a deployment"))
        if self.versioned:
            return None  # one task, one revision: load does not move it
        total = sum(d.live.in_flight for d in eligible)
        bound = math.ceil(self.cfg.affinity_load_factor * (total + 1) / len(eligible))
        if kept.live.in_flight + 1 > bound:
            return (
                f"loaded past the affinity bound ({kept.live.in_flight} in flight, bound {bound})"
            )
        return None

    def _ring_pick(self, prefix: str, eligible: list[Deployment]) -> tuple[Deployment, str]:
        """The first deployment clockwise from the prefix's hash that is eligible and
        within the load bound (consistent hashing with bounded load)."""
        total = sum(d.live.in_flight for d in eligible)
        bound = math.ceil(self.cfg.affinity_load_factor * (total + 1) / len(eligible))
        start = bisect.bisect_left(self._ring_points, _hash(prefix.encode("utf-8", "replace")))
        ring, n = self._ring, len(self._ring)
        first: Deployment | None = None
        seen: set[str] = set()
        for i in range(n):
            d = ring[(start + i) % n]
            if d.name in seen:
                continue
            seen.add(d.name)
            if not any(x is d for x in eligible):
                continue
            if first is None:
                first = d
            if d.live.in_flight + 1 <= bound:
                return d, "its point" if d is first else f"next on the ring ({first.name} full)"
            if len(seen) == len(self.deployments):
                break
        # every eligible one is at the bound: the least loaded
        now = time.monotonic()
        d = min(eligible, key=lambda x: _load(x, now))
        return d, "every deployment at the load bound: the least loaded"

    def _pick(self, eligible: list[Deployment], tokens: int, now: float) -> tuple[Deployment, str]:
        if len(eligible) == 1:
            return eligible[0], "the only eligible deployment"
        strategy = self.cfg.strategy
        if strategy == "weighted":
            return self._weighted(eligible), "weighted random"
        if strategy == "least_outstanding":
            a = self._weighted(eligible)
            b = self._weighted([d for d in eligible if d is not a])
            load_a, load_b = _load(a, now), _load(b, now)
            if load_b < load_a:
                a, b, load_a, load_b = b, a, load_b, load_a
            return a, (
                f"fewer in flight of two random choices ({a.name}: {load_a}, "
                f"{b.name}: {load_b}; an engine's own running and waiting count when it "
                "reports more)"
            )
        stale = [d for d in eligible if now - d.live.last_sample > self.cfg.stale_s]
        if stale:
            d = min(stale, key=lambda x: x.live.last_sample)
            return d, "latency: not measured recently, probed first"
        ranked = sorted(eligible, key=lambda x: _score(x, tokens, now))
        if self.rng.random() < self.cfg.probe:
            return self.rng.choice(ranked[1:]), "latency: the probe share (a random other)"
        best = ranked[0]
        return best, (
            f"latency: lowest expected time ({_score(best, tokens, now) * 1000:.0f} ms, "
            "its engine's waiting requests counted)"
        )

    def _weighted(self, eligible: list[Deployment]) -> Deployment:
        """One of `eligible`, at random by weight."""
        total = 0.0
        for d in eligible:
            total += d.live.weight
        x = self.rng.random() * total
        for d in eligible:
            x -= d.live.weight
            if x < 0:
                return d
        return eligible[-1]

    # -- after the request --------------------------------------------------------
    def set_weights(self, weights: Mapping[str, float]) -> dict[str, float]:
        """Set deployments' weights by name (`d0` or `alias/d0`); returns what changed."""
        changed = {}
        for d in self.deployments:
            w = weights.get(_short(d), weights.get(d.name))
            if w is not None and w != d.live.weight:
                d.live.weight = float(w)
                changed[d.name] = float(w)
        return changed

    def config_weights(self) -> dict[str, float]:
        return {d.replica.name: d.replica.weight for d in self.deployments if d.replica is not None}

    def canaries(self) -> list[Deployment]:
        return [d for d in self.deployments if d.replica is not None and d.replica.canary]

    def promote(self) -> dict[str, float]:
        """The weights that give the canaries all the traffic (the others 0)."""
        return self._canary_weights("promote")

    def rollback(self) -> dict[str, float]:
        """The weights that give the canaries none, the others their configured one."""
        return self._canary_weights("rollback")

    def _canary_weights(self, action: Literal["promote", "rollback"]) -> dict[str, float]:
        configured = {_short(d): _weight(d) for d in self.deployments}
        return canary_weights(action, configured, {_short(d) for d in self.canaries()})

    def weights(self) -> dict[str, float]:
        return {_short(d): d.live.weight for d in self.deployments}

    def guard_check(self, d: Deployment, ok: bool, e2e_ms: float, now: float) -> str | None:
        """Record a canary's outcome; when its window (with the other processes', when
        shared) breaches the guard's bounds and it still has weight, cut it to 0 and say
        why (None otherwise)."""
        if self.guard is None or d.replica is None or not d.replica.canary:
            return None
        own = self._tally(d, now, (now, ok, e2e_ms))
        if self._share is not None:
            self._share.poke()
        return self._judge(d, own)

    def guard_windows(self, now: float) -> dict[str, tuple[GuardCounts, float]]:
        """Each canary's counts in this process's window, with the window's length (what
        it shares: state/guard.py)."""
        assert self.guard is not None  # shared only with a guard
        return {d.name: (self._tally(d, now), self.guard.window_s) for d in self.canaries()}

    def guard_adopt(self, others: Mapping[str, GuardCounts], now: float) -> None:
        """The other processes' counts (empty: judge alone from now on); each canary is
        judged over them with its own, since an outcome elsewhere is not an event here,
        and a cut goes to `on_cut`."""
        self._others = others
        for d in self.canaries():
            why = self._judge(d, self._tally(d, now))
            if why is not None and self._on_cut is not None:
                self._on_cut(self.alias, d, why)

    def _tally(
        self, d: Deployment, now: float, outcome: tuple[float, bool, float] | None = None
    ) -> GuardCounts:
        """`d`'s window with `outcome` added and what is older than the guard's window
        dropped, as counts kept up to date as outcomes enter and leave it."""
        g = self.guard
        assert g is not None
        window = d.live.outcomes
        counts = self._counts[d.name]
        if outcome is not None:
            window.append(outcome)
            _count(counts, outcome, g.max_p95_ms, 1)
        cutoff = now - g.window_s
        while window and window[0][0] < cutoff:
            _count(counts, window.popleft(), g.max_p95_ms, -1)
        return GuardCounts(*counts)

    def _judge(self, d: Deployment, own: GuardCounts) -> str | None:
        """Cut `d` to weight 0 when its counts with the others' breach a bound: why."""
        g = self.guard
        assert g is not None
        others = self._others.get(d.name, NONE)
        c = own.plus(others)
        if d.live.weight <= 0 or c.n < g.min_samples:
            return None
        rate = c.errors / c.n
        if rate > g.max_error_rate:
            why = f"error rate {rate:.2f} > {g.max_error_rate:g} over {c.n} requests"
        elif g.max_p95_ms is not None and c.good and c.slow >= c.good - int(c.good * 0.95):
            # The p95 (the int(0.95 * good)-th latency, sorted) is above the bound exactly
            # when that many successes from the top were slower: counts decide it.
            if others.good:  # latencies elsewhere: the count is what is known
                why = (
                    f"p95 > {g.max_p95_ms:g} ms ({c.slow} of {c.good} successful requests"
                    f" slower) over {c.n} requests"
                )
            else:
                lat = sorted(ms for _, good, ms in d.live.outcomes if good)
                p95 = lat[int(len(lat) * 0.95)]
                why = f"p95 {p95:.0f} ms > {g.max_p95_ms:g} ms over {c.n} requests"
        else:
            return None
        if others.n:
            why += f" ({others.n} of them in other gateway processes)"
        d.live.weight = 0.0
        why = f"the canary guard cut {d.name} to weight 0: {why} in {g.window_s:g}s"
        if not any(x.live.weight > 0 for x in self.deployments) and self.rolled_back():
            why += f"; {ROLLED_BACK}"
        return why

    def rolled_back(self) -> bool:
        """After a cut left no deployment any weight (a promoted canary failing: a state
        the weights API refuses, in which every request would go to the first listed,
        maybe the cut canary): the rollback's weights, so the stable deployments take
        the traffic again. False when the rollback gives none weight either."""
        weights = self.rollback()
        if not any(w > 0 for w in weights.values()):
            return False
        self.set_weights(weights)
        return True

    def settled(
        self,
        d: Deployment,
        ttft_s: float | None,
        tpot_s: float | None,
        now: float | None = None,
    ) -> None:
        """The request sent to `d` is over: it is no longer in flight, and its
        latencies (when it got an answer) update the EWMAs."""
        live = d.live
        live.in_flight = max(0, live.in_flight - 1)
        a = self.cfg.ewma_alpha
        if ttft_s is not None:
            live.ttft_s = ttft_s if live.ttft_s is None else (1 - a) * live.ttft_s + a * ttft_s
            live.ttft_ms = round(live.ttft_s * 1000.0, 1)
            live.last_sample = time.monotonic() if now is None else now
        if tpot_s is not None:
            live.tpot_s = tpot_s if live.tpot_s is None else (1 - a) * live.tpot_s + a * tpot_s
            live.tpot_ms = round(live.tpot_s * 1000.0, 2)


def _count(
    counts: list[int], outcome: tuple[float, bool, float], bound: float | None, sign: int
) -> None:
    """Add (sign 1) or take away (-1) one outcome in a guard's counts [n, errors, good,
    slow]: slow is a success over `bound` (the guard's max_p95_ms)."""
    _, ok, ms = outcome
    counts[0] += sign
    if not ok:
        counts[1] += sign
        return
    counts[2] += sign
    if bound is not None and ms > bound:
        counts[3] += sign


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prompt_prefix(req: Generation, min_chars: int, max_chars: int) -> str | None:
    """The first `max_chars` characters of the prompt (roles and texts of the messages
    in order, or a completion's prompt), or None when it is shorter than `min_chars`."""
    parts: list[str] = []
    n = 0
    messages = req.messages
    if messages is not None:
        for m in messages:
            c = m.get("content")
            if isinstance(c, list):
                c = "".join(
                    p["text"] for p in c if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
            if not isinstance(c, str):
                continue
            parts.append(str(m.get("role"))[:16])
            parts.append(c)
            n += len(c) + 1
            if n >= max_chars:
                break
    else:
        prompt = req.prompt
        if isinstance(prompt, str):
            parts.append(prompt[:max_chars])
    text = "\x00".join(parts)[:max_chars]
    return text if len(text) >= min_chars else None


def _short(d: Deployment) -> str:
    return d.replica.name if d.replica is not None else d.name


def _weight(d: Deployment) -> float:
    return d.replica.weight if d.replica is not None else 1.0


def _load(d: Deployment, now: float) -> int:
    """Requests on `d`'s engine: this gateway's in flight, or what the engine itself
    reports running and waiting (other clients' included) when that is more and fresh."""
    engine = d.live.engine_now(now)
    own = d.live.in_flight
    return own if engine is None else max(own, engine.queued)


def _score(d: Deployment, tokens: int, now: float) -> float:
    """Expected seconds for `tokens` on `d`: its time to first token and per-token time
    (EWMAs), stretched by the requests its engine says wait for a place in its batch
    (each of the running ones frees one)."""
    expected = (d.live.ttft_s or 0.0) + (d.live.tpot_s or 0.0) * tokens
    engine = d.live.engine_now(now)
    if engine is not None and engine.waiting:
        expected *= 1 + engine.waiting / max(engine.running or 0, 1)
    return expected


def _bounded(value: str) -> str:
    """An affinity key as kept: itself, or past `_KEY_CHARS` characters the SHA-256 of
    all of it (so two long keys sharing a prefix stay two)."""
    if len(value) <= _KEY_CHARS:
        return value
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "replace")).hexdigest()


def affinity_key(task_id: str | None, req: Generation, headers: Any) -> tuple[str, str] | None:
    """The request's task or session, as ("task" | "session", value), or None; a value
    past 256 characters is its hash (what the session store keeps too). The header is
    bounded where it is read: the server's `max_header_bytes` (431 past it)."""
    if task_id:
        return ("task", _bounded(task_id))
    cache_key = req.prompt_cache_key
    if isinstance(cache_key, str) and cache_key:
        return ("session", _bounded(cache_key))
    if headers is not None:
        session = headers.get("x-session-id")
        if session:
            return ("session", _bounded(str(session)))
    user = req.user
    if isinstance(user, str) and user:
        return ("session", _bounded(user))
    return None

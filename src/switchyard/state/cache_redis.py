"""Response-cache entries shared by every gateway process through Redis (the Redis
implementation of state/cache.py's entries).

Each process keeps its own `ResponseCache` (decide/cache.py): lookups stay in memory, with no round trip
on the request path. Redis holds each entry once and tells the other processes about
every change:

    {prefix}e:{exact key}   the packed entry (header JSON, vector, body), expiring with
                            the entry's TTL
    {prefix}events          Pub/Sub channel: b"P" + packed entry when a process stores
                            one; b"I" + filter JSON when one invalidates; b"T" + JSON
                            when shadow evidence moved a partition's threshold
    {prefix}thresholds      hash: partition -> its raise, for processes that catch up
                            (kept THRESHOLDS_TTL_S after the last move)

A store is one pipelined round trip (SET + PUBLISH). The others apply events in their
event loop as they arrive; `lags` keeps the latest creation-to-searchable delays (wall
clock, so across machines it includes their clock skew). Pub/Sub queues nothing for a
disconnected subscriber, so every (re)subscription is followed by a resync: each entry
in Redis that the local index lacks is loaded, and each older local entry that Redis
no longer holds is dropped. Redis is the truth.

An invalidation deletes the matching entries from Redis (a SCAN of the entry keys: an
admin operation, rare) and publishes its filter; every process applies it to its own
index and remembers it for `RECENT_S`, so an entry made before the invalidation whose
store raced with it (published after the SCAN passed it) is dropped on arrival, and
deleted from Redis, instead of coming back.

Redis being unreachable never fails a request: a store stays local (counted, logged)
and lookups are in memory anyway; the resync after reconnecting brings the process back
in line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from typing import Any

import numpy as np
import orjson
from redis.exceptions import RedisError

from switchyard.state.cache import CacheKeys, Entry, LocalEntries, matches
from switchyard.state.redis import count_failure, listen, redis_client

log = logging.getLogger("switchyard.cache")

RECENT_S = 30.0  # how long an invalidation filter still drops late, older entries
THRESHOLDS_TTL_S = 7 * 86400
_PARTITION_MAX = 256  # a partition key is a hash; longer is not ours
_FILTERS = ("tenant", "model", "tag", "partition")
_HEADER_MAX = 64 * 1024  # a header beyond this is not ours


def pack(origin: str, entry: Entry, vec: np.ndarray | None) -> bytes:
    k = entry.keys
    v = b"" if vec is None else np.asarray(vec, dtype="<f4").tobytes()
    header = orjson.dumps(
        {
            "origin": origin,
            "partition": k.partition,
            "exact": k.exact,
            "query": k.query,
            "tags": list(k.tags),
            "tenant": k.tenant,
            "model": k.model,
            "revision": k.revision,
            "answered_model": k.answered_model,
            "answered_revision": k.answered_revision,
            "created": entry.created,
            "expires": entry.expires,
            "vec_bytes": len(v),
        }
    )
    return len(header).to_bytes(4, "big") + header + v + entry.body


def unpack(raw: bytes) -> tuple[dict[str, Any], CacheKeys, np.ndarray | None, bytes] | None:
    """The header, keys, vector and body of a packed entry; None when it is not one."""
    try:
        n = int.from_bytes(raw[:4], "big")
        if not 0 < n <= min(_HEADER_MAX, len(raw) - 4):
            return None
        h = orjson.loads(raw[4 : 4 + n])
        vb = int(h["vec_bytes"])
        if vb < 0 or vb % 4 or 4 + n + vb > len(raw):
            return None
        keys = CacheKeys(
            str(h["partition"]),
            str(h["exact"]),
            str(h["query"]),
            tuple(str(t) for t in h["tags"]),
            str(h["tenant"]),
            str(h["model"]),
            str(h.get("revision", "")),  # an entry packed before revisions were kept
            str(h.get("answered_model", "")),  # ...before what answered was kept
            str(h.get("answered_revision", "")),
        )
        float(h["created"]), float(h["expires"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    vec = np.frombuffer(raw[4 + n : 4 + n + vb], dtype="<f4").astype(np.float32) if vb else None
    return h, keys, vec, bytes(raw[4 + n + vb :])


class SharedCache:
    def __init__(
        self,
        cache: LocalEntries,
        url: str,
        timeout_s: float,
        prefix: str = "switchyard:cache:",
    ) -> None:
        self.cache = cache
        self._redis = redis_client(url, timeout_s)
        self.prefix = prefix
        self.channel = prefix + "events"
        self.origin = f"{os.getpid()}-{os.urandom(6).hex()}"
        self.errors = 0
        self.applied = 0
        self.resyncs = 0
        self.lags: deque[float] = deque(maxlen=2048)  # seconds, latest stores applied
        self.inv_lags: deque[float] = deque(maxlen=256)  # seconds, latest invalidations
        self._recent: deque[tuple[float, dict[str, Any]]] = deque(maxlen=256)
        self.subscribed = asyncio.Event()  # set once a resync has completed

    def _key(self, exact: str) -> str:
        return f"{self.prefix}e:{exact}"

    async def close(self) -> None:
        await self._redis.aclose()

    # -- writes ---------------------------------------------------------------------
    async def put(self, entry: Entry, vec: np.ndarray | None) -> bool:
        """Store `entry` (already in the local cache) for every process; False when
        Redis could not take it (it then stays local)."""
        ttl_ms = int((entry.expires - time.time()) * 1000)
        if ttl_ms <= 0:
            return False
        packed = pack(self.origin, entry, vec)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(self._key(entry.keys.exact), packed, px=ttl_ms)
                pipe.publish(self.channel, b"P" + packed)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed("store", exc)
            return False
        return True

    async def threshold_moved(self, partition: str, raise_by: float) -> None:
        """Tell every process that `partition`'s threshold moved (decide/shadow_threshold.py)."""
        event = orjson.dumps({"origin": self.origin, "partition": partition, "raise_by": raise_by})
        key = self.prefix + "thresholds"
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, partition, repr(float(raise_by)))
                pipe.expire(key, int(THRESHOLDS_TTL_S))
                pipe.publish(self.channel, b"T" + event)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed("threshold", exc)

    def _adopt(self, partition: Any, raise_by: Any) -> None:
        if isinstance(partition, bytes):
            partition = partition.decode(errors="replace")
        if isinstance(raise_by, bytes):
            raise_by = raise_by.decode(errors="replace")
        try:
            value = float(raise_by)
        except (TypeError, ValueError):
            return
        if isinstance(partition, str) and len(partition) <= _PARTITION_MAX and value == value:
            self.cache.adopt_threshold(partition, value)

    async def invalidate(self, f: dict[str, Any], dry_run: bool) -> dict[str, Any]:
        """Remove the matching entries from Redis and tell every process (the local
        index is the caller's). Raises RedisError/OSError: an admin asked, and must
        know that the other processes did not hear it."""
        matched: list[bytes] = []
        size = 0
        async for batch in self._scan():
            for key, raw in batch:
                got = unpack(raw)
                if got is not None and matches(got[1], f):
                    matched.append(key)
                    size += len(raw)
        if not dry_run:
            self._recent.append((time.time(), f))
            async with self._redis.pipeline(transaction=False) as pipe:
                for i in range(0, len(matched), 512):
                    pipe.delete(*matched[i : i + 512])
                event = {"origin": self.origin, "at": time.time(), **f}
                pipe.publish(self.channel, b"I" + orjson.dumps(event))
                await pipe.execute()
        return {"matched": len(matched), "removed": 0 if dry_run else len(matched), "bytes": size}

    async def _scan(self) -> Any:
        """Batches of (key, packed entry) of every entry in Redis."""
        pending: list[bytes] = []
        async for key in self._redis.scan_iter(match=self._key("*"), count=1000):
            pending.append(key)
            if len(pending) >= 256:
                yield await self._values(pending)
                pending = []
        if pending:
            yield await self._values(pending)

    async def _values(self, keys: list[bytes]) -> list[tuple[bytes, bytes]]:
        values = await self._redis.mget(keys)  # bytes: the client does not decode
        return [(k, v) for k, v in zip(keys, values, strict=True) if isinstance(v, bytes)]

    # -- the other processes' changes ------------------------------------------------
    async def listen(self) -> None:
        """Apply the other processes' stores and invalidations until cancelled;
        resubscribes and resyncs after Redis comes back."""

        async def subscribed() -> None:
            await self.resync()
            self.subscribed.set()

        def lost(exc: BaseException) -> None:
            self.subscribed.clear()
            self._failed("subscription", exc)

        await listen(self._redis, self.channel, self.apply, subscribed, lost)

    def apply(self, data: bytes) -> None:
        if data[:1] == b"T":
            try:
                moved = orjson.loads(data[1:])
            except orjson.JSONDecodeError:
                return
            if isinstance(moved, dict) and moved.get("origin") != self.origin:
                self._adopt(moved.get("partition"), moved.get("raise_by"))
            return
        if data[:1] == b"P":
            got = unpack(data[1:])
            if got is not None and got[0]["origin"] != self.origin:
                self._add(*got)
        elif data[:1] == b"I":
            try:
                f = orjson.loads(data[1:])
            except orjson.JSONDecodeError:
                return
            if not isinstance(f, dict) or f.get("origin") == self.origin:
                return
            at = f.get("at")
            f = {k: f.get(k) for k in _FILTERS}
            if any(v is not None and not isinstance(v, str) for v in f.values()):
                return
            if all(v is None for v in f.values()):
                return
            now = time.time()
            self._recent.append((now, f))
            self.cache.invalidate(**f)
            self.applied += 1
            if isinstance(at, float):
                self.inv_lags.append(max(0.0, now - at))

    def _add(self, h: dict[str, Any], keys: CacheKeys, vec: np.ndarray | None, body: bytes) -> bool:
        now = time.time()
        created, expires = float(h["created"]), float(h["expires"])
        if expires <= now:
            return False
        have = self.cache.entry(keys.exact)
        if have is not None and have.created >= created:
            return False
        for at, f in self._recent:
            if created <= at and now - at < RECENT_S and matches(keys, f):
                # Made before an invalidation that its store raced with: gone.
                task = asyncio.ensure_future(self._forget(keys.exact, created))
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
                return False
        try:
            self.cache.store(keys, body, vec, ttl_s=expires - created, now=created)
        except ValueError:  # a vector of another embedding model
            return False
        self.lags.append(max(0.0, now - created))
        self.applied += 1
        return True

    async def _forget(self, exact: str, created: float) -> None:
        """Delete a raced entry from Redis, unless it has been stored again since."""
        with contextlib.suppress(RedisError, OSError):
            raw = await self._redis.get(self._key(exact))
            got = unpack(raw) if isinstance(raw, bytes) else None
            if got is not None and float(got[0]["created"]) <= created:
                await self._redis.delete(self._key(exact))

    async def resync(self) -> int:
        """Load what Redis has and this index lacks; drop older local entries Redis no
        longer holds. Returns the entries loaded."""
        started = time.time()
        seen: set[str] = set()
        loaded = 0
        async for batch in self._scan():
            for _, raw in batch:
                got = unpack(raw)
                if got is None:
                    continue
                seen.add(got[1].exact)
                loaded += self._add(*got)
            await asyncio.sleep(0)  # let requests run between batches
        for e in self.cache.entries():
            if e.created < started and e.keys.exact not in seen:
                self.cache.drop(e)
        moved = await self._redis.hgetall(self.prefix + "thresholds")
        for partition, raise_by in list(moved.items())[:10_000]:
            self._adopt(partition, raise_by)
        self.resyncs += 1
        return loaded

    # -- reporting --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        def q(xs: deque[float], p: float) -> float | None:
            s = sorted(xs)
            return round(s[min(len(s) - 1, int(p * len(s)))] * 1000, 3) if s else None

        return {
            "redis": True,
            "subscribed": self.subscribed.is_set(),
            "applied": self.applied,
            "resyncs": self.resyncs,
            "errors": self.errors,
            "store_lag_ms_p50": q(self.lags, 0.50),
            "store_lag_ms_p99": q(self.lags, 0.99),
            "invalidation_lag_ms_p99": q(self.inv_lags, 0.99),
        }

    def _failed(self, what: str, exc: BaseException) -> None:
        self.errors = count_failure(
            log, self.errors, f"shared cache {what} (entries stay local)", exc
        )

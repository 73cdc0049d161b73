"""`RedisLimiter`: the `MemoryLimiter` semantics (state/limits_memory.py), shared by
several gateway processes.

Every reservation and settlement is one Lua script, so the check-then-record of all
scopes happens atomically on the Redis server: two processes racing for the last unit
of a budget cannot both win, and a refusal by one scope records nothing in the others.

Time is the caller's `now`, never the server clock, so windows behave exactly like the
in-process ones (and tests can drive the clock). Per scope the keys are:

    {prefix}rl:{scope}:req       sorted set: reservation → time (requests window)
    {prefix}rl:{scope}:tok       sorted set: reservation → time (tokens window)
    {prefix}rl:{scope}:tokamt    hash: reservation → tokens
    {prefix}rl:{scope}:toktotal  running token total of the window
    {prefix}rl:{scope}:inflight  sorted set: reservation → lease expiry
    {prefix}rl:{scope}:spent:{period key}   USD spent incl. reservations

A reservation is `{request id}#{sequence number}`, not the bare request id: request ids
may come from the client's `x-request-id`, and a client reusing one must still be
counted once per request. `{prefix}rl:held:{request id}` queues the sequence numbers
of the request's unsettled reservations, so `settle` knows which one it ends and a
second `settle` finds nothing left to release.

A process that dies mid-request never settles: its concurrency slots would lapse only
after `LEASE_S` and its reserved budget and tokens would stay counted. So a limiter
built with an `owner` (one per gateway worker) also records each reservation, in the
same script, in

    {prefix}rl:owner:{owner}     hash: reservation → [request id, sequence number,
                                 reserved cost, its keys, its scopes' budget flags]

which its settle removes it from (it settles that owner's oldest hold of the request,
so two workers that received the same client request id never settle each other's);
`release_owner(owner)`, from any process (the supervisor's), settles each reservation
still there as a settle with nothing used would: concurrency slots freed, reserved
tokens and budget returned, the request still counted in its requests window. Each
release runs the settle script, so it happens once: a second release, or the owner's
own late settle, finds nothing left. Without an owner nothing is recorded.

Reserves and settles issued while an earlier one is on the wire reach Redis together,
in one pipelined round trip (state/redis_batch.py); each is still its own script,
atomic by itself.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable
from typing import Any

import orjson

from switchyard.state.limits import (
    WINDOW_S,
    Ask,
    Period,
    ScopeLimits,
    Verdict,
    period_key,
    period_reset_s,
)
from switchyard.state.redis import redis_client, shared_call
from switchyard.state.redis_batch import ScriptBatcher

# A process that dies mid-request never settles; its concurrency slots lapse after this
# (unless its owner's holds are released first) and so do the records of its holds.
LEASE_S = 600.0
# Budget keys must outlive the longest period (a 31-day month) and then go away.
BUDGET_TTL_S = 40 * 86400
_KEYS_PER_SCOPE = 6


_LUA_COMMON = """
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local function fmt(x) return string.format('%.17g', x) end
"""

# Both scripts: KEYS are the seq counter, the request's held list, 6 per scope, then the
# owner's hash when the limiter has an owner.
_LUA_KEYS = """
local n = math.floor((#KEYS - 2) / 6)
local owner = nil
if #KEYS > 2 + 6 * n then owner = KEYS[#KEYS] end
"""

# ARGV: now, window, lease, budget ttl, request id, ask tokens, ask cost, then per scope
# rpm, tpm, concurrency, budget ("" = unlimited) and seconds to the budget period's
# rollover.
_RESERVE = (
    _LUA_COMMON
    + _LUA_KEYS
    + """
local lease, budget_ttl, rid = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local need, cost = tonumber(ARGV[6]), tonumber(ARGV[7])
local cutoff = fmt(now - window)

local function reset_s(z)
  local first = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
  if #first == 0 then return 0 end
  return math.max(0, tonumber(first[2]) + window - now)
end

local function expire_tokens(z, h, t)
  local total = tonumber(redis.call('GET', t) or '0')
  local old = redis.call('ZRANGEBYSCORE', z, '-inf', cutoff)
  for i = 1, #old, 1000 do  -- chunks: unpack() has a stack limit
    local chunk = {unpack(old, i, math.min(i + 999, #old))}
    local amounts = redis.call('HMGET', h, unpack(chunk))
    for j = 1, #chunk do total = total - tonumber(amounts[j] or '0') end
    redis.call('HDEL', h, unpack(chunk))
  end
  if #old > 0 then redis.call('ZREMRANGEBYSCORE', z, '-inf', cutoff) end
  if redis.call('ZCARD', z) == 0 then total = 0 end  -- heals any drift
  if #old > 0 then redis.call('SET', t, fmt(total), 'KEEPTTL') end
  return total
end

local function tokens_retry(z, h, total, limit)
  local excess, freed = total + need - limit, 0
  local entries = redis.call('ZRANGE', z, 0, -1, 'WITHSCORES')
  for i = 1, #entries, 2 do
    freed = freed + tonumber(redis.call('HGET', h, entries[i]) or '0')
    if freed >= excess then return math.max(0.001, tonumber(entries[i + 1]) + window - now) end
  end
  return window
end

local refusal, scopes = nil, {}
for s = 1, n do
  local k, a = 2 + (s - 1) * 6, 7 + (s - 1) * 5
  local sc = {rpm = tonumber(ARGV[a + 1]), tpm = tonumber(ARGV[a + 2]),
              conc = tonumber(ARGV[a + 3]), budget = tonumber(ARGV[a + 4]),
              out = {0, 0, 0, 0, 0}}
  scopes[s] = sc
  redis.call('ZREMRANGEBYSCORE', KEYS[k + 1], '-inf', cutoff)
  sc.tokens = expire_tokens(KEYS[k + 2], KEYS[k + 3], KEYS[k + 4])
  redis.call('ZREMRANGEBYSCORE', KEYS[k + 5], '-inf', fmt(now))  -- lapsed leases
  if sc.rpm then
    local count = redis.call('ZCARD', KEYS[k + 1])
    sc.out[1], sc.out[2] = math.max(0, sc.rpm - count), reset_s(KEYS[k + 1])
    if not refusal and count + 1 > sc.rpm then
      local retry, idx = window, count + 1 - sc.rpm
      if idx <= count then
        local e = redis.call('ZRANGE', KEYS[k + 1], idx - 1, idx - 1, 'WITHSCORES')
        retry = math.max(0.001, tonumber(e[2]) + window - now)
      end
      refusal = {s, 'rpm', retry}
    end
  end
  if sc.tpm then
    sc.out[3], sc.out[4] = math.max(0, sc.tpm - sc.tokens), reset_s(KEYS[k + 2])
    if not refusal and sc.tokens + need > sc.tpm then
      local retry = -1  -- never fits: infinity
      if need <= sc.tpm then retry = tokens_retry(KEYS[k + 2], KEYS[k + 3], sc.tokens, sc.tpm) end
      refusal = {s, 'tpm', retry}
    end
  end
  if sc.conc and not refusal and redis.call('ZCARD', KEYS[k + 5]) + 1 > sc.conc then
    refusal = {s, 'concurrency', 1}
  end
  if sc.budget then
    sc.spent = tonumber(redis.call('GET', KEYS[k + 6]) or '0')
    sc.out[5] = math.max(0, sc.budget - sc.spent)
    if not refusal and sc.spent + cost > sc.budget + 1e-12 then
      refusal = {s, 'budget', tonumber(ARGV[a + 5])}
    end
  end
end

local function reply(allowed, r)
  local res = {allowed, r[1], r[2], fmt(r[3])}
  for s = 1, n do
    for i = 1, 5 do res[#res + 1] = fmt(scopes[s].out[i]) end
  end
  return res
end
if refusal then return reply(0, refusal) end

local seq = redis.call('INCR', KEYS[1])
local member = rid .. '#' .. seq
local window_ms = math.floor(2 * window * 1000)
for s = 1, n do
  local k, sc = 2 + (s - 1) * 6, scopes[s]
  if sc.rpm then
    redis.call('ZADD', KEYS[k + 1], fmt(now), member)
    redis.call('PEXPIRE', KEYS[k + 1], window_ms)
    sc.out[1] = sc.out[1] - 1
  end
  if sc.tpm then
    redis.call('ZADD', KEYS[k + 2], fmt(now), member)
    redis.call('HSET', KEYS[k + 3], member, fmt(need))
    redis.call('SET', KEYS[k + 4], fmt(sc.tokens + need))
    for i = 2, 4 do redis.call('PEXPIRE', KEYS[k + i], window_ms) end
    sc.out[3] = math.max(0, sc.out[3] - need)
  end
  if sc.conc then
    redis.call('ZADD', KEYS[k + 5], fmt(now + lease), member)
    redis.call('PEXPIRE', KEYS[k + 5], math.floor(lease * 1000))
  end
  if sc.budget then redis.call('SET', KEYS[k + 6], fmt(sc.spent + cost), 'EX', budget_ttl) end
end
redis.call('RPUSH', KEYS[2], seq)
redis.call('PEXPIRE', KEYS[2], math.floor(lease * 1000))
if owner then  -- what release_owner needs to settle it from another process
  local keys, flags = {}, ''
  for i = 1, 2 + 6 * n do keys[i] = KEYS[i] end
  for s = 1, n do flags = flags .. (scopes[s].budget and '1' or '0') end
  redis.call('HSET', owner, member, cjson.encode({rid, tostring(seq), ARGV[7], keys, flags}))
  redis.call('PEXPIRE', owner, math.floor(lease * 1000))
end
return reply(1, {0, '', 0})
"""
)

# ARGV: now, window, budget ttl, request id, real tokens, reserved cost, real cost, the
# sequence number to settle ("" = the request's oldest hold; set by release_owner), then
# per scope 1 if it has a budget else 0. Returns 1 if it settled a hold, else 0.
_SETTLE = (
    _LUA_COMMON
    + _LUA_KEYS
    + """
local budget_ttl, rid = tonumber(ARGV[3]), ARGV[4]
local tokens, reserved, real = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local seq = nil
if ARGV[8] ~= '' then  -- release_owner: this hold, if its owner still has it
  if redis.call('HDEL', owner, rid .. '#' .. ARGV[8]) == 0 then return 0 end
  if redis.call('LREM', KEYS[2], 1, ARGV[8]) == 0 then return 0 end  -- lease lapsed
  seq = ARGV[8]
elseif owner then  -- the owner's oldest hold of the request
  for _, held in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
    if redis.call('HDEL', owner, rid .. '#' .. held) == 1 then
      redis.call('LREM', KEYS[2], 1, held)
      seq = held
      break
    end
  end
  if not seq then return 0 end  -- already settled or released, or the lease lapsed
else
  seq = redis.call('LPOP', KEYS[2])
  if not seq then return 0 end  -- already settled, or the lease lapsed
end
local member = rid .. '#' .. seq
for s = 1, n do
  local k = 2 + (s - 1) * 6
  local old = redis.call('HGET', KEYS[k + 3], member)
  if old then  -- still in the tokens window
    local total = tonumber(redis.call('GET', KEYS[k + 4]) or '0')
    redis.call('HSET', KEYS[k + 3], member, fmt(tokens))
    redis.call('SET', KEYS[k + 4], fmt(total + (tokens - tonumber(old))), 'KEEPTTL')
  end
  redis.call('ZREM', KEYS[k + 5], member)
  if ARGV[8 + s] == '1' then
    local spent = tonumber(redis.call('GET', KEYS[k + 6]) or '0')
    redis.call('SET', KEYS[k + 6], fmt(math.max(0, spent - reserved + real)), 'EX', budget_ttl)
  end
end
return 1
"""
)


def _arg(value: float | None) -> str:
    """Lossless text for Lua's tonumber (repr round-trips a double); "" for unlimited."""
    return "" if value is None else repr(float(value))


class RedisLimiter:
    """Limiter whose state lives in Redis, so all gateway processes share one limit.

    Same semantics as `MemoryLimiter`. Raises `LimiterUnavailable` when Redis cannot be
    reached; the caller applies its fail_open / fail_closed policy. `owner` names the
    process whose holds `release_owner` can release should it die (module docstring).
    """

    def __init__(
        self,
        url: str,
        prefix: str = "switchyard:",
        timeout_s: float = 0.5,
        owner: str | None = None,
    ) -> None:
        self._redis = redis_client(url, timeout_s)
        self._prefix = f"{prefix}rl:"
        self._owner_key = None if owner is None else self._owner(owner)
        # Every request's reserve and settle: batched, one round trip for many requests.
        self._scripts = ScriptBatcher(self._redis)
        self._reserve = self._scripts.register(_RESERVE)
        self._settle = self._scripts.register(_SETTLE)

    def _owner(self, owner: str) -> str:
        return f"{self._prefix}owner:{owner}"

    async def close(self) -> None:
        await self._scripts.close()
        await self._redis.aclose()

    def _keys(self, scopes: list[ScopeLimits], request_id: str, now: float) -> list[str]:
        keys = [f"{self._prefix}seq", f"{self._prefix}held:{request_id}"]
        for lim in scopes:
            base = f"{self._prefix}{lim.scope}:"
            keys += [base + s for s in ("req", "tok", "tokamt", "toktotal", "inflight")]
            keys.append(f"{base}spent:{period_key(lim.budget_period, now)}")
        if self._owner_key is not None:
            keys.append(self._owner_key)
        return keys

    async def _call(self, what: str, coro: Awaitable[Any]) -> Any:
        return await shared_call("limiter", what, coro)

    async def seed_spent(
        self, scope: str, period: Period, usd: float, now: float | None = None
    ) -> bool:
        """Seed a budget from the usage ledger at startup, unless it is already live.

        SET NX: the first process to start seeds it; later ones must not overwrite the
        counter that running processes have moved on since. True when this call set it.
        """
        now = time.time() if now is None else now
        key = f"{self._prefix}{scope}:spent:{period_key(period, now)}"
        setter = self._redis.set(key, _arg(usd), nx=True, ex=BUDGET_TTL_S)
        return bool(await self._call("seed_spent", setter))

    async def reserve(
        self, scopes: list[ScopeLimits], ask: Ask, now: float | None = None
    ) -> Verdict:
        """Admit `ask` against every scope or none; on admission everything is held."""
        now = time.time() if now is None else now
        args = [_arg(now), _arg(WINDOW_S), _arg(LEASE_S), str(BUDGET_TTL_S), ask.request_id]
        args += [_arg(ask.tokens), _arg(ask.cost_usd)]
        for lim in scopes:
            args += [_arg(lim.rpm), _arg(lim.tpm), _arg(lim.max_concurrency)]
            args += [_arg(lim.budget_usd), _arg(period_reset_s(lim.budget_period, now))]
        keys = self._keys(scopes, ask.request_id, now)
        res = await self._call("reserve", self._scripts.run(self._reserve, keys, args))
        verdict = Verdict(allowed=bool(int(res[0])))
        if not verdict.allowed:
            verdict.scope = scopes[int(res[1]) - 1].scope
            verdict.limit = res[2].decode()
            retry = float(res[3])
            verdict.retry_after_s = math.inf if retry < 0 else retry
        for i, lim in enumerate(scopes):
            out = [float(v) for v in res[4 + 5 * i : 9 + 5 * i]]
            info: dict[str, float] = {}
            if lim.rpm is not None:
                info["limit_requests"] = lim.rpm
                info["remaining_requests"], info["reset_requests_s"] = out[0], out[1]
            if lim.tpm is not None:
                info["limit_tokens"] = lim.tpm
                info["remaining_tokens"], info["reset_tokens_s"] = out[2], out[3]
            if lim.budget_usd is not None:
                info["budget_remaining_usd"] = out[4]
            verdict.state[lim.scope] = info
        return verdict

    async def settle(
        self,
        scopes: list[ScopeLimits],
        ask: Ask,
        tokens: int,
        cost_usd: float,
        now: float | None = None,
    ) -> None:
        """The request ended: real tokens and cost replace the reserved ones and its
        concurrency slot is released. A repeated call finds nothing held and does nothing."""
        now = time.time() if now is None else now
        args = [_arg(now), _arg(WINDOW_S), str(BUDGET_TTL_S), ask.request_id, _arg(tokens)]
        args += [_arg(ask.cost_usd), _arg(cost_usd), ""]
        args += ["0" if lim.budget_usd is None else "1" for lim in scopes]
        keys = self._keys(scopes, ask.request_id, now)
        await self._call("settle", self._scripts.run(self._settle, keys, args))

    async def release_owner(self, owner: str, now: float | None = None) -> int:
        """Settle every hold `owner` left unsettled (its process died) as a settle with
        nothing used would; return how many were released. Any limiter over the same
        Redis and prefix may call it; a second call finds nothing left."""
        now = time.time() if now is None else now
        key = self._owner(owner)
        held = await self._call("release_owner", self._redis.hgetall(key))
        released = 0
        for raw in held.values():
            rid, seq, cost, keys, flags = orjson.loads(raw)
            args = [_arg(now), _arg(WINDOW_S), str(BUDGET_TTL_S), rid, "0", cost, "0.0", seq]
            args += list(flags)
            settled = await self._call("release_owner", self._settle(keys=[*keys, key], args=args))
            released += int(settled)
        return released

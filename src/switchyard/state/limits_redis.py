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
                                 reserved cost, its keys, reserved tokens, billing]

which its settle removes it from (it settles that owner's oldest hold of the request,
so two workers that received the same client request id never settle each other's).
`billing` is what the caller gave for the request's usage row (`limits.Billing`: its
ids, tenant, key, endpoint, model), kept as it came. `release_holds(owner)`, from any
process (the supervisor's), ends each reservation still there as used in full: the
request may have gone upstream and streamed before its process died, so what it
reserved stays charged (its tokens in the tokens window, its cost in the budget; the
supervisor writes its usage row at that cost) and only its concurrency slots are
freed. It returns what it ended (`limits.Held`); `release_owner` counts them. Each
release runs the settle script, so it happens once: a second release, or the owner's
own late settle, finds nothing left. Without an owner nothing is recorded. (A record
an earlier version wrote, [.., its keys, its scopes' budget flags], is ended the same
way, without billing.)

Reserves and settles issued while an earlier one is on the wire reach Redis together,
in one pipelined round trip (state/redis_batch.py); each is still its own script,
atomic by itself. A round trip whose connection drops is sent once more, and Redis may
have run it before the drop: so each reserve carries its own call id, and the script
records `{prefix}rl:call:{call id}` (for CALL_TTL_S) when it admits; a reserve that
finds its call's key answers as admitted and holds nothing more. A settle sent twice
finds the hold gone the second time (a reservation id is one request's and stage's).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import Awaitable
from functools import partial
from typing import Any

import orjson

from switchyard.state.limits import (
    WINDOW_S,
    Ask,
    Billing,
    Held,
    LimiterUnavailable,
    Period,
    ScopeLimits,
    Verdict,
    period_key,
    period_reset_s,
)
from switchyard.state.redis import redis_client, shared_call
from switchyard.state.redis_batch import ScriptBatcher

log = logging.getLogger("switchyard.limits")

# A process that dies mid-request never settles; its concurrency slots lapse after this
# (unless its owner's holds are released first) and so do the records of its holds.
LEASE_S = 600.0
# Budget keys must outlive the longest period (a 31-day month) and then go away.
BUDGET_TTL_S = 40 * 86400
_KEYS_PER_SCOPE = 6
# How long an admitted reserve's call key says it ran (a resent call comes within the
# client's timeout, a few seconds at most).
CALL_TTL_S = 60.0


# Constants, so written into the scripts rather than sent with each call. Arguments of
# redis.call are given as text: Redis formats a Lua number argument with %.17g each time.
_LUA_COMMON = f"""
local window, lease = {WINDOW_S!r}, {LEASE_S!r}
local window_ms, lease_ms = '{int(2 * WINDOW_S * 1000)}', '{int(LEASE_S * 1000)}'
local budget_ttl = '{BUDGET_TTL_S}'
local call_ms = '{int(CALL_TTL_S * 1000)}'
"""
_LUA_COMMON += """
local call, max, tonumber, format = redis.call, math.max, tonumber, string.format
local function fmt(x) return format('%.17g', x) end
"""

# Both scripts: KEYS are the seq counter, the request's held list, 6 per scope, then the
# owner's hash when the limiter has an owner.
_LUA_KEYS = """
local n = math.floor((#KEYS - 2) / 6)
local owner = nil
if #KEYS > 2 + 6 * n then owner = KEYS[#KEYS] end
"""

# KEYS: as `_LUA_KEYS`, then the call's own key (`{prefix}rl:call:{call id}`) last.
# ARGV: now, request id, ask tokens, ask cost, the owner record's text before and after
# its sequence number ("" without an owner), the call's id, then per scope rpm, tpm,
# concurrency, budget ("" = unlimited) and seconds to the budget period's rollover (""
# without a budget).
# The call's key is how a call sent twice is applied once: a batch whose connection
# dropped after Redis ran it and before its reply was read is sent again (redis_batch.py),
# and a reserve that finds its call's key already there (its first sending admitted it)
# answers as admitted again, with the state as it is, and holds nothing more.
# A window's oldest member is read first: only when it has left the window does the
# script look for more to expire, and while it has not, that one read is all the
# expiring costs. (Reading a few oldest members at once, to find what left and the oldest
# left in one read, measured no cheaper.) A window of a limit the scope does not have is
# neither read nor expired: its keys lapse with their TTL, or its members are expired
# once the limit is set again.
_RESERVE = (
    _LUA_COMMON
    + """
local n = math.floor((#KEYS - 3) / 6)
local owner, done = nil, KEYS[#KEYS]
if #KEYS > 3 + 6 * n then owner = KEYS[#KEYS - 1] end
local at, rid = ARGV[1], ARGV[2]  -- at: now as the caller wrote it (lossless)
local now, need, cost = tonumber(at), tonumber(ARGV[3]), tonumber(ARGV[4])
local edge = now - window  -- members at or before it have left the window

local function oldest(z)  -- the score of z's oldest member; nil when z is empty
  return tonumber(call('ZRANGE', z, '0', '0', 'WITHSCORES')[2])
end

local function reset_s(first)
  if not first then return 0 end
  return max(0, first + window - now)
end

local function expire_requests(z)  -- returns the oldest member left
  local first = oldest(z)
  if first and first <= edge then
    call('ZREMRANGEBYSCORE', z, '-inf', fmt(edge))
    first = oldest(z)
  end
  return first
end

local function expire_tokens(z, h, t)  -- returns the window's total and oldest member
  local first = oldest(z)
  if not first then return 0, nil end  -- empty: heals any drift
  local total = tonumber(call('GET', t) or '0')
  if first > edge then return total, first end
  local cutoff = fmt(edge)
  local old = call('ZRANGEBYSCORE', z, '-inf', cutoff)
  for i = 1, #old, 1000 do  -- chunks: unpack() has a stack limit
    local chunk = {unpack(old, i, math.min(i + 999, #old))}
    local amounts = call('HMGET', h, unpack(chunk))
    for j = 1, #chunk do total = total - tonumber(amounts[j] or '0') end
    call('HDEL', h, unpack(chunk))
  end
  call('ZREMRANGEBYSCORE', z, '-inf', cutoff)
  first = oldest(z)
  if not first then total = 0 end  -- heals any drift
  call('SET', t, fmt(total), 'KEEPTTL')
  return total, first
end

local function tokens_retry(z, h, total, limit)
  local excess, freed = total + need - limit, 0
  local entries = call('ZRANGE', z, '0', '-1', 'WITHSCORES')
  for i = 1, #entries, 2 do
    freed = freed + tonumber(call('HGET', h, entries[i]) or '0')
    if freed >= excess then return max(0.001, tonumber(entries[i + 1]) + window - now) end
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
  if sc.rpm then
    local first = expire_requests(KEYS[k + 1])
    local count = 0
    if first then count = call('ZCARD', KEYS[k + 1]) end
    sc.out[1], sc.out[2] = max(0, sc.rpm - count), reset_s(first)
    if not refusal and count + 1 > sc.rpm then
      local retry, idx = window, count + 1 - sc.rpm
      if idx <= count then
        local e = call('ZRANGE', KEYS[k + 1], idx - 1, idx - 1, 'WITHSCORES')
        retry = max(0.001, tonumber(e[2]) + window - now)
      end
      refusal = {s, 'rpm', retry}
    end
  end
  if sc.tpm then
    local first
    sc.tokens, first = expire_tokens(KEYS[k + 2], KEYS[k + 3], KEYS[k + 4])
    sc.out[3], sc.out[4] = max(0, sc.tpm - sc.tokens), reset_s(first)
    if not refusal and sc.tokens + need > sc.tpm then
      local retry = -1  -- never fits: infinity
      if need <= sc.tpm then retry = tokens_retry(KEYS[k + 2], KEYS[k + 3], sc.tokens, sc.tpm) end
      refusal = {s, 'tpm', retry}
    end
  end
  if sc.conc then
    call('ZREMRANGEBYSCORE', KEYS[k + 5], '-inf', at)  -- lapsed leases
    if not refusal and call('ZCARD', KEYS[k + 5]) + 1 > sc.conc then
      refusal = {s, 'concurrency', 1}
    end
  end
  if sc.budget then
    sc.spent = tonumber(call('GET', KEYS[k + 6]) or '0')
    sc.out[5] = max(0, sc.budget - sc.spent)
    if not refusal and sc.spent + cost > sc.budget + 1e-12 then
      refusal = {s, 'budget', tonumber(ARGV[a + 5])}
    end
  end
end

-- An integer goes back as an integer reply (exact below 2^53); other numbers as
-- lossless text, since a Lua number becomes an integer reply, truncated.
local exact = 2 ^ 53
local function num(x)
  if x % 1 == 0 and x > -exact and x < exact then return x end
  return fmt(x)
end
local function reply(allowed, r)
  local res = {allowed, r[1], r[2], num(r[3])}
  for s = 1, n do
    local out = scopes[s].out
    for i = 1, 5 do res[#res + 1] = num(out[i]) end
  end
  return res
end
-- This call was sent before and admitted (its reply lost with its connection).
if call('EXISTS', done) == 1 then return reply(1, {0, '', 0}) end
if refusal then return reply(0, refusal) end

local seq = tostring(call('INCR', KEYS[1]))
call('SET', done, seq, 'PX', call_ms)
local member = rid .. '#' .. seq
local amount = fmt(need)
for s = 1, n do
  local k, sc = 2 + (s - 1) * 6, scopes[s]
  if sc.rpm then
    call('ZADD', KEYS[k + 1], at, member)
    call('PEXPIRE', KEYS[k + 1], window_ms)
    sc.out[1] = sc.out[1] - 1
  end
  if sc.tpm then
    call('ZADD', KEYS[k + 2], at, member)
    call('HSET', KEYS[k + 3], member, amount)
    call('SET', KEYS[k + 4], fmt(sc.tokens + need), 'PX', window_ms)
    call('PEXPIRE', KEYS[k + 2], window_ms)
    call('PEXPIRE', KEYS[k + 3], window_ms)
    sc.out[3] = max(0, sc.out[3] - need)
  end
  if sc.conc then
    call('ZADD', KEYS[k + 5], fmt(now + lease), member)
    call('PEXPIRE', KEYS[k + 5], lease_ms)
  end
  if sc.budget then call('SET', KEYS[k + 6], fmt(sc.spent + cost), 'EX', budget_ttl) end
end
call('RPUSH', KEYS[2], seq)
call('PEXPIRE', KEYS[2], lease_ms)
if owner then  -- what release_holds needs to end it from another process
  call('HSET', owner, member, ARGV[5] .. seq .. ARGV[6])
  call('PEXPIRE', owner, lease_ms)
end
return reply(1, {0, '', 0})
"""
)

# ARGV: request id, real tokens, reserved cost, real cost, the sequence number to settle
# ("" = the request's oldest hold; set by release_holds), then per scope what the hold has
# there to return (`_holds`). Returns 1 if it settled a hold, else 0.
_SETTLE = (
    _LUA_COMMON
    + _LUA_KEYS
    + """
local rid, pick = ARGV[1], ARGV[5]
local tokens, reserved, real = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local seq = nil
if pick ~= '' then  -- release_holds: this hold, if its owner still has it
  if call('HDEL', owner, rid .. '#' .. pick) == 0 then return 0 end
  -- A lapsed lease: its owner's settle may have found nothing and billed it already.
  if call('LREM', KEYS[2], '1', pick) == 0 then return 0 end
  seq = pick
elseif owner then  -- the owner's oldest hold of the request
  for _, held in ipairs(call('LRANGE', KEYS[2], '0', '-1')) do
    if call('HDEL', owner, rid .. '#' .. held) == 1 then
      call('LREM', KEYS[2], '1', held)
      seq = held
      break
    end
  end
  if not seq then return 0 end  -- already settled or released, or the lease lapsed
else
  seq = call('LPOP', KEYS[2])
  if not seq then return 0 end  -- already settled, or the lease lapsed
end
local member, amount, find = rid .. '#' .. seq, nil, string.find
for s = 1, n do
  local k, holds = 2 + (s - 1) * 6, ARGV[5 + s]
  local old = find(holds, 't', 1, true) and call('HGET', KEYS[k + 3], member)
  if old then  -- still in the tokens window
    amount = amount or fmt(tokens)
    local total = tonumber(call('GET', KEYS[k + 4]) or '0')
    call('HSET', KEYS[k + 3], member, amount)
    call('SET', KEYS[k + 4], fmt(total + (tokens - tonumber(old))), 'KEEPTTL')
  end
  if find(holds, 'c', 1, true) then call('ZREM', KEYS[k + 5], member) end
  if find(holds, 'b', 1, true) then
    local spent = tonumber(call('GET', KEYS[k + 6]) or '0')
    call('SET', KEYS[k + 6], fmt(max(0, spent - reserved + real)), 'EX', budget_ttl)
  end
end
return 1
"""
)


def _arg(value: float | None) -> str:
    """Lossless text for Lua's tonumber (repr round-trips a double); "" for unlimited."""
    return "" if value is None else repr(float(value))


def _holds(lim: ScopeLimits) -> str:
    """What a hold has in scope `lim` for settle to return: "t" tokens, "c" a
    concurrency slot, "b" budget. Only what the scope limits is held there."""
    return (
        ("t" if lim.tpm is not None else "")
        + ("c" if lim.max_concurrency is not None else "")
        + ("b" if lim.budget_usd is not None else "")
    )


def _owner_record(rid: str, cost: str, keys: list[str], ask: Ask) -> tuple[str, str]:
    """The owner record (JSON: request id, sequence number, reserved cost, keys,
    reserved tokens, billing; release_holds reads it) before and after its sequence
    number, which only the reserve script knows: it writes the three together,
    encoding nothing itself."""
    head = orjson.dumps([rid]).decode()[:-1] + ',"'
    tail = '",' + orjson.dumps([cost, keys, ask.tokens, ask.billing], default=tuple).decode()[1:]
    return head, tail


def _billing(value: Any) -> Billing | None:
    """An owner record's billing, as `Billing`; None when it has none, or one of
    another layout (no usage row can be made of it)."""
    if not isinstance(value, list) or len(value) != len(Billing._fields):
        return None
    return Billing(*value)


class RedisLimiter:
    """Limiter whose state lives in Redis, so all gateway processes share one limit.

    Same semantics as `MemoryLimiter`. Raises `LimiterUnavailable` when Redis cannot be
    reached; the caller applies its fail_open / fail_closed policy. `owner` names the
    process whose holds `release_holds` can end should it die (module docstring).
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
        # A reserve call's id (`_RESERVE`'s call key): this limiter's tag and a count.
        self._tag = secrets.token_hex(8)
        self._calls = 0
        # Every request's reserve and settle: batched, one round trip for many requests.
        self._scripts = ScriptBatcher(self._redis)
        # Settles of reservations whose caller was cancelled meanwhile (`_settle_orphan`).
        self._orphans: set[asyncio.Task[None]] = set()
        self._reserve = self._scripts.register(_RESERVE)
        self._settle = self._scripts.register(_SETTLE)

    def _owner(self, owner: str) -> str:
        return f"{self._prefix}owner:{owner}"

    @property
    def owned(self) -> bool:
        """Whether its holds are recorded in an owner's name (so a reserve's `Ask`
        carries billing: `release_holds`)."""
        return self._owner_key is not None

    async def close(self) -> None:
        if self._orphans:
            await asyncio.gather(*self._orphans, return_exceptions=True)
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
        args = [_arg(now), ask.request_id, _arg(ask.tokens), _arg(ask.cost_usd)]
        keys = self._keys(scopes, ask.request_id, now)
        if self._owner_key is None:
            args += ["", ""]
        else:
            args += _owner_record(ask.request_id, args[3], keys[:-1], ask)
        self._calls += 1
        call_id = f"{self._tag}.{self._calls:x}"  # this call's, kept if it is sent again
        args.append(call_id)
        keys.append(f"{self._prefix}call:{call_id}")
        for lim in scopes:
            args += [_arg(lim.rpm), _arg(lim.tpm), _arg(lim.max_concurrency)]
            if lim.budget_usd is None:
                args += ["", ""]
            else:
                args += [_arg(lim.budget_usd), _arg(period_reset_s(lim.budget_period, now))]
        orphaned = partial(self._settle_orphan, scopes, ask, now)
        res = await self._call("reserve", self._scripts.run(self._reserve, keys, args, orphaned))
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

    def _settle_orphan(self, scopes: list[ScopeLimits], ask: Ask, now: float, reply: Any) -> None:
        """A reserve whose caller was cancelled (a task's cancel, shutdown) after it was
        sent: the script ran for nobody, and that caller will never settle. What it
        reserved is settled unused: the slot, tokens and budget come back, and the
        request still counts in its requests window.
        An error may hide a script that ran: a settle that finds nothing does nothing."""
        if not isinstance(reply, BaseException) and not int(reply[0]):
            return  # refused: nothing was held
        task = asyncio.ensure_future(self._release(scopes, ask, now))
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    async def _release(self, scopes: list[ScopeLimits], ask: Ask, now: float) -> None:
        try:
            await self.settle(scopes, ask, 0, 0.0, now=now)  # the reserve's budget period
        except LimiterUnavailable as exc:  # its lease and TTLs end it
            log.warning("a cancelled request's reservation was not released: %s", exc)

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
        args = [ask.request_id, _arg(tokens), _arg(ask.cost_usd), _arg(cost_usd), ""]
        args += [_holds(lim) for lim in scopes]
        keys = self._keys(scopes, ask.request_id, now)
        await self._call("settle", self._scripts.run(self._settle, keys, args))

    async def release_holds(self, owner: str) -> list[Held]:
        """End every hold `owner` left unsettled (its process died) as used in full
        (module docstring): only its concurrency slots come back. Returns the holds
        this call ended, for their usage rows. Any limiter over the same Redis and
        prefix may call it; a second call finds nothing left."""
        key = self._owner(owner)
        records = await self._call("release_owner", self._redis.hgetall(key))
        ended: list[Held] = []
        for raw in records.values():
            rid, seq, cost, keys, *rest = orjson.loads(raw)
            # A slot where none was held finds nothing and changes nothing; tokens and
            # budget are not returned ("c" alone per scope).
            args = [rid, "0", cost, cost, seq, *["c"] * ((len(keys) - 2) // 6)]
            settled = await self._call("release_owner", self._settle(keys=[*keys, key], args=args))
            if int(settled):
                tokens, billing = (rest[0], _billing(rest[1])) if len(rest) == 2 else (0, None)
                ended.append(Held(rid, int(tokens), float(cost), billing))
        return ended

    async def release_owner(self, owner: str, now: float | None = None) -> int:
        """`release_holds`, counted: how many holds it ended. (`now`, the clock of the
        other calls, goes unused: a release depends on no time.)"""
        return len(await self.release_holds(owner))

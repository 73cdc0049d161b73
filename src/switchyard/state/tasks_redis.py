"""`RedisTaskStore`: the `MemoryTaskStore` semantics, shared by several gateway processes.

Admission and settlement are one Lua script each, so check-then-reserve happens
atomically on the Redis server: two processes admitting the last call a budget
allows cannot both win. The rule the script applies is `state.tasks.check`, in the
same order (cancelled, deadline, calls or tool calls, tokens, cost);
tests/integration/test_task_governance.py
runs both stores over generated sequences of calls and compares every answer.

Per task (tenant, task id) the keys are, all expiring `tasks.idle_ttl_s` after the
task's last call:

    {prefix}task:{tenant}:{task}          hash: budget, deadline, use, refusals, cancel
                                          (the task id's ':' written '/')
    {prefix}task:{tenant}:{task}:held     hash: request id → "tokens cost kind ext"
                                          reserved (kind 1: a tool call, 0: a model
                                          call; ext: the extensions it holds, `extend`)
    {prefix}task:{tenant}:{task}:calls    hash: tool-call id → its note (JSON)
    {prefix}task:{tenant}:{task}:order    list: the noted call ids, oldest first

and `{prefix}task-index` (a sorted set: task key → the number of its last admission,
from the counter `{prefix}task-index:seq`), with `{prefix}task-index:t:{tenant}` (the
same, a tenant's tasks alone) and `{prefix}task-index:tenants` (tenant → how many it
holds), bounds their count as the memory store does: past `tasks.max_tasks` the
admission that made one too many deletes the keys of the least recently admitted task
of the tenant holding the most (on a tie the admitting tenant's; never the task it
admits), so another tenant's flood of new task ids cannot drop a tenant's cancel or
used budget. Their tool-call notes are capped at `tasks.max_tool_calls` per task, the
oldest dropped first. (The scripts touch keys they compute, so they assume one Redis
server, not a cluster.)

A gateway worker that dies mid-call never settles, so its calls' reserved tokens and
cost would stay counted in their tasks until those expire. A store built with an
`owner` (one per worker) also records, in the admitting script,

    {prefix}task-owner:{owner}    hash: [task key, request id] (JSON) → 1

which settle removes; `release_owner(owner)`, from any process (the supervisor's),
settles each call still there as having used what it reserved: it may have reached
the upstream and streamed, so its tokens and cost stay spent in the task (a task's
budget is never passed), as the limiter keeps a dead worker's reservations and the
supervisor bills them (scale/workers.py), and it stays counted among the task's
calls. A release runs the settle script, so a second one, or the worker's own late
settle, finds nothing held. Without an owner nothing is recorded.

Times are the caller's `now`, never the server clock, as in `RedisLimiter`. A cancel
is published on `{prefix}task-cancel`; every gateway process listens (`listen`) and
stops the task's calls it has in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import orjson

from switchyard.identity import TaskBudget
from switchyard.state.limits import LimiterUnavailable
from switchyard.state.redis import listen, redis_client, shared_call
from switchyard.state.tasks import (
    TaskAdmission,
    TaskFirst,
    TaskKey,
    ToolCallNote,
    first_deadline,
    note_dict,
)

log = logging.getLogger("switchyard")

# KEYS: state, held, index, then the owner's hash when the store has an owner. ARGV:
# now, ttl, calls, tokens, cost, wall, deadline_at, deadline_by ('' = none), request id,
# tokens asked, cost asked, max tasks, tool calls, whether this is a tool call ('1') or
# a model call ('0'), the tenant, the length of the task keys' prefix (before the
# tenant). A request id holds one admission per task (the gateway's own id:
# one per request): a call the task holds already is answered admitted, not applied again.
_ADMIT = """
local k, held, index, owner = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local seq, tenant, tenants = redis.call('INCR', index .. ':seq'), ARGV[15], index .. ':tenants'
local mine = index .. ':t:' .. tenant
redis.call('ZADD', index, seq, k)
redis.call('ZADD', mine, seq, k)
redis.call('ZADD', tenants, redis.call('ZCARD', mine), tenant)
-- Past the bound the tenant holding the most states loses its own least recently
-- admitted one (on a tie the admitting tenant, then the greatest tenant id), never k;
-- when every tenant holds one, the least recently admitted of all goes.
local over, plen = redis.call('ZCARD', index) - tonumber(ARGV[12]), tonumber(ARGV[16])
while over > 0 do
  local victim = nil
  local top = redis.call('ZREVRANGE', tenants, 0, 0, 'WITHSCORES')
  local most = tonumber(top[2] or '0')
  if most >= 2 then
    local t = top[1]
    if tonumber(redis.call('ZSCORE', tenants, tenant) or '0') == most then t = tenant end
    victim = redis.call('ZRANGE', index .. ':t:' .. t, 0, 0)[1]
  end
  if not victim or victim == k then
    local two = redis.call('ZRANGE', index, 0, 1)
    victim = two[1]
    if victim == k then victim = two[2] end
  end
  redis.call('DEL', victim, victim .. ':held', victim .. ':calls', victim .. ':order')
  redis.call('ZREM', index, victim)
  local of = string.match(string.sub(victim, plen + 1), '^([^:]*):')
  if of then
    local theirs = index .. ':t:' .. of
    redis.call('ZREM', theirs, victim)
    local left = redis.call('ZCARD', theirs)
    if left > 0 then redis.call('ZADD', tenants, left, of) else redis.call('ZREM', tenants, of) end
  end
  over = over - 1
end
if redis.call('EXISTS', k) == 0 then
  redis.call('HSET', k, 'started_at', ARGV[1], 'b_calls', ARGV[3], 'b_tokens', ARGV[4],
    'b_cost', ARGV[5], 'b_wall', ARGV[6], 'deadline_at', ARGV[7], 'deadline_by', ARGV[8],
    'b_tools', ARGV[13], 'u_calls', 0, 'u_tokens', 0, 'u_cost', 0, 'u_tools', 0)
end
local rid, tokens, cost = ARGV[9], tonumber(ARGV[10]), tonumber(ARGV[11])
local tool = ARGV[14] == '1'
local s = redis.call('HMGET', k, 'b_calls', 'b_tokens', 'b_cost', 'deadline_at',
  'deadline_by', 'u_calls', 'u_tokens', 'u_cost', 'cancelled_at', 'b_tools', 'u_tools')
local b_calls, b_tokens, b_cost = tonumber(s[1]), tonumber(s[2]), tonumber(s[3])
local deadline_at, deadline_by = tonumber(s[4]), s[5]
local u_calls, u_tokens, u_cost = tonumber(s[6]), tonumber(s[7]), tonumber(s[8])
local b_tools, u_tools = tonumber(s[10]), tonumber(s[11]) or 0
if redis.call('HEXISTS', held, rid) == 1 then
  -- Held already: this admission sent again (the client resends a call once when the
  -- connection drops, and Redis may have run it before the drop). Counted once.
  redis.call('EXPIRE', k, ttl)
  return {'', tostring(u_calls), tostring(u_tokens), tostring(u_cost), tostring(u_tools)}
end
local refused = ''
if s[9] then
  refused = 'cancelled'
elseif deadline_at and now >= deadline_at then
  if deadline_by == 'wall_s' then refused = 'wall_s' else refused = 'deadline' end
elseif tool and b_tools and u_tools + 1 > b_tools then
  refused = 'tool_calls'
elseif (not tool) and b_calls and u_calls + 1 > b_calls then
  refused = 'calls'
elseif b_tokens and u_tokens + tokens > b_tokens then
  refused = 'tokens'
elseif b_cost and u_cost + cost > b_cost + 1e-12 then
  refused = 'cost_usd'
end
if refused == '' then
  local kind = 0
  if tool then
    u_tools = redis.call('HINCRBY', k, 'u_tools', 1)
    kind = 1
  else
    u_calls = redis.call('HINCRBY', k, 'u_calls', 1)
  end
  u_tokens = redis.call('HINCRBYFLOAT', k, 'u_tokens', tokens)
  u_cost = redis.call('HINCRBYFLOAT', k, 'u_cost', cost)
  redis.call('HSET', held, rid, string.format('%.17g %.17g %d 0', tokens, cost, kind))
  if owner then
    redis.call('HSET', owner, cjson.encode({k, rid}), 1)
    redis.call('EXPIRE', owner, ttl)
  end
else
  redis.call('HINCRBY', k, 'r_' .. refused, 1)
end
redis.call('EXPIRE', k, ttl)
redis.call('EXPIRE', held, ttl)
return {refused, tostring(u_calls), tostring(u_tokens), tostring(u_cost), tostring(u_tools)}
"""

# KEYS: state, held, then the owner's hash when the store has an owner. ARGV: request
# id, tokens used, cost used, called (1/0), and '1' when release_owner settles (only
# if the owner still has the call; it keeps what the call reserved as used). Returns 1
# if it settled a call, else 0.
_SETTLE = """
local k, held, owner = KEYS[1], KEYS[2], KEYS[3]
if owner and redis.call('HDEL', owner, cjson.encode({k, ARGV[1]})) == 0
    and ARGV[5] == '1' then
  return 0
end
local h = redis.call('HGET', held, ARGV[1])
if not h or redis.call('EXISTS', k) == 0 then return 0 end
redis.call('HDEL', held, ARGV[1])
local parts = {}
for part in string.gmatch(h, '%S+') do table.insert(parts, part) end
local r_tokens, r_cost = tonumber(parts[1]), tonumber(parts[2])
local function lower(field, by)
  local v = (tonumber(redis.call('HGET', k, field)) or 0) + by
  if v < 0 then v = 0 end
  redis.call('HSET', k, field, string.format('%.17g', v))
end
if ARGV[5] ~= '1' then
  lower('u_tokens', tonumber(ARGV[2]) - r_tokens)
  lower('u_cost', tonumber(ARGV[3]) - r_cost)
end
if ARGV[4] == '0' then
  if parts[3] == '1' then lower('u_tools', -1) else lower('u_calls', -1) end
end
return 1
"""

# KEYS: state, held. ARGV: request id, the extension's number, tokens, cost, ttl. One
# more upstream call's tokens and cost held for a call the task holds (`extend`), the
# rule `state.tasks.check_more` (tokens, then cost); an extension the call holds
# already (sent again) is answered held, not applied again. Returns nil when the task
# or the call's hold is gone, else [refused or '', calls, tokens, cost, tool calls].
_EXTEND = """
local k, held, rid = KEYS[1], KEYS[2], ARGV[1]
local h = redis.call('HGET', held, rid)
if not h or redis.call('EXISTS', k) == 0 then return false end
local parts = {}
for part in string.gmatch(h, '%S+') do table.insert(parts, part) end
local n, tokens, cost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local s = redis.call('HMGET', k, 'b_tokens', 'b_cost', 'u_calls', 'u_tokens', 'u_cost', 'u_tools')
local b_tokens, b_cost = tonumber(s[1]), tonumber(s[2])
local u_tokens, u_cost = tonumber(s[4]), tonumber(s[5])
local refused = ''
if tonumber(parts[4] or '0') < n then
  if b_tokens and u_tokens + tokens > b_tokens then
    refused = 'tokens'
  elseif b_cost and u_cost + cost > b_cost + 1e-12 then
    refused = 'cost_usd'
  else
    u_tokens = redis.call('HINCRBYFLOAT', k, 'u_tokens', tokens)
    u_cost = redis.call('HINCRBYFLOAT', k, 'u_cost', cost)
    redis.call('HSET', held, rid, string.format('%.17g %.17g %s %d',
      tonumber(parts[1]) + tokens, tonumber(parts[2]) + cost, parts[3], n))
  end
end
redis.call('EXPIRE', k, tonumber(ARGV[5]))
redis.call('EXPIRE', held, tonumber(ARGV[5]))
return {refused, tostring(s[3]), tostring(u_tokens), tostring(u_cost), tostring(s[6] or 0)}
"""

# KEYS: state. ARGV: now, ttl. The cancel time, or nil for an unknown task.
_CANCEL = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
redis.call('HSETNX', KEYS[1], 'cancelled_at', ARGV[1])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
return redis.call('HGET', KEYS[1], 'cancelled_at')
"""

# KEYS: calls, order, state. ARGV: ttl, max notes, then call id and note JSON pairs.
# A call noted again moves to the end; past the cap the oldest notes (and their
# result counts) go. Nothing is noted for a task that is gone.
_NOTE = """
local calls, order = KEYS[1], KEYS[2]
if redis.call('EXISTS', KEYS[3]) == 0 then return 0 end
for i = 3, #ARGV, 2 do
  redis.call('HSET', calls, ARGV[i], ARGV[i + 1])
  redis.call('LREM', order, 0, ARGV[i])
  redis.call('RPUSH', order, ARGV[i])
end
local over = redis.call('LLEN', order) - tonumber(ARGV[2])
for _ = 1, over do
  local old = redis.call('LPOP', order)
  redis.call('HDEL', calls, old, 'results:' .. old)
end
redis.call('EXPIRE', calls, tonumber(ARGV[1]))
redis.call('EXPIRE', order, tonumber(ARGV[1]))
return 0
"""

# KEYS: calls. ARGV: call ids. Each known call's result count goes up; returns
# [id, note JSON, count, ...] of the known ones.
_RESULTS = """
local out = {}
for i = 1, #ARGV do
  local note = redis.call('HGET', KEYS[1], ARGV[i])
  if note then
    local n = redis.call('HINCRBY', KEYS[1], 'results:' .. ARGV[i], 1)
    table.insert(out, ARGV[i]); table.insert(out, note); table.insert(out, n)
  end
end
return out
"""

# KEYS: the task's calls hash. ARGV: call ids whose counted results are taken back.
_UNRESULTS = """
for i = 1, #ARGV do
  local f = 'results:' .. ARGV[i]
  if tonumber(redis.call('HGET', KEYS[1], f) or '0') > 0 then
    redis.call('HINCRBY', KEYS[1], f, -1)
  end
end
return 0
"""


def _num(v: Any) -> float | None:
    if v is None or v == b"" or v == "":
        return None
    return float(v)


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _opt(v: float | None) -> str:
    return "" if v is None else repr(float(v))


class RedisTaskStore:
    """Task state in Redis, shared by every gateway process (module docstring)."""

    def __init__(
        self,
        url: str,
        prefix: str = "switchyard:",
        timeout_s: float = 0.5,
        idle_ttl_s: float = 3600.0,
        max_calls: int = 1000,
        max_tasks: int = 100_000,
        owner: str | None = None,
    ) -> None:
        self._redis = redis_client(url, timeout_s)
        self._prefix = f"{prefix}task:"
        self._owners = f"{prefix}task-owner:"
        # The admit and settle scripts' last key, when this process's calls are recorded.
        self._owner_keys = [] if owner is None else [self._owners + owner]
        self._index = f"{prefix}task-index"
        self._channel = f"{prefix}task-cancel"
        self.idle_ttl_s = idle_ttl_s
        self.max_calls = max_calls
        self.max_tasks = max_tasks
        self._admit = self._redis.register_script(_ADMIT)
        self._settle = self._redis.register_script(_SETTLE)
        self._extend = self._redis.register_script(_EXTEND)
        self._cancel = self._redis.register_script(_CANCEL)
        self._results = self._redis.register_script(_RESULTS)
        self._unresults = self._redis.register_script(_UNRESULTS)
        self._note_calls = self._redis.register_script(_NOTE)
        # Settles of admissions whose caller was cancelled meanwhile (`admit`).
        self._orphans: set[asyncio.Task[None]] = set()

    def _k(self, key: TaskKey) -> str:
        # Both parts are validated ids (no ':' in a tenant id, no '/' in a task id). A
        # task id's ':' is written '/', so no task's key is another's `:held`,
        # `:calls` or `:order` (task `x:held` was task `x`'s reservations, and ran
        # without its budget).
        return f"{self._prefix}{key[0]}:{key[1].replace(':', '/')}"

    @property
    def _ttl(self) -> int:
        return max(1, int(self.idle_ttl_s + 0.999))

    async def _call(self, what: str, coro: Awaitable[Any]) -> Any:
        return await shared_call("task state", what, coro)

    async def admit(
        self,
        key: TaskKey,
        first: TaskFirst,
        rid: str,
        tokens: int,
        cost: float,
        now: float,
        tool: bool = False,
    ) -> TaskAdmission:
        """Admit a call of the task. Its caller's cancellation (the task's own cancel
        fanning out, shutdown) does not cut the admission short: once the script is
        sent it runs, and a caller cancelled meanwhile would never settle what it held.
        So the admission runs on by itself, and one that held the call for a caller
        that has gone is settled unused (not a call, nothing charged)."""
        k = self._k(key)
        deadline_at, by = first_deadline(first, now)
        b = first.budget
        args = [
            repr(now),
            self._ttl,
            _opt(b.calls),
            _opt(b.tokens),
            _opt(b.cost_usd),
            _opt(b.wall_s),
            _opt(deadline_at),
            by or "",
            rid,
            tokens,
            repr(float(cost)),
            self.max_tasks,
            _opt(b.tool_calls),
            "1" if tool else "0",
            key[0],
            len(self._prefix),
        ]
        work = asyncio.ensure_future(self._admitted(k, args, now))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            work.add_done_callback(partial(self._settle_orphan, key, rid))
            raise

    def _settle_orphan(self, key: TaskKey, rid: str, done: asyncio.Future[TaskAdmission]) -> None:
        if done.cancelled():
            return  # the loop is shutting down: the task's idle TTL ends it
        if done.exception() is None and not done.result().allowed:
            return  # refused: nothing was held
        # An error may hide a script that ran: a settle that finds nothing does nothing.
        task = asyncio.ensure_future(self._release(key, rid))
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    async def _release(self, key: TaskKey, rid: str) -> None:
        try:
            await self.settle(key, rid, 0, 0.0, called=False)
        except LimiterUnavailable as exc:
            log.warning("a cancelled call's hold on its task was not released: %s", exc)

    async def _admitted(self, k: str, args: list[Any], now: float) -> TaskAdmission:
        """The admit script run for the task at key `k` with `args`, and the task's
        state read back: the call's admission."""
        keys = [k, k + ":held", self._index, *self._owner_keys]
        out = await self._call("admit", self._admit(keys=keys, args=args))
        return await self._answer(k, out, now, "admit")

    async def _answer(self, k: str, out: list[Any], now: float, what: str) -> TaskAdmission:
        """The store's answer from a script's reply `out` ([refused or '', calls,
        tokens, cost, tool calls]) and the task's state read back."""
        refused = _str(out[0]) or None
        fields = await self._call(what, self._redis.hgetall(k))
        f = {_str(a): b for a, b in fields.items()}
        bc, bt, bu, bw, btools, started, d_at, d_by, cancelled = (
            f.get(n)
            for n in (
                "b_calls", "b_tokens", "b_cost", "b_wall", "b_tools", "started_at",
                "deadline_at", "deadline_by", "cancelled_at",
            )
        )  # fmt: skip
        budget = TaskBudget(
            int(_num(bc)) if _num(bc) is not None else None,  # type: ignore[arg-type]
            int(_num(bt)) if _num(bt) is not None else None,  # type: ignore[arg-type]
            _num(bu),
            _num(bw),
            int(_num(btools)) if _num(btools) is not None else None,  # type: ignore[arg-type]
        )
        return TaskAdmission(
            refused is None,
            refused,
            budget.as_dict(),
            {
                "calls": float(out[1]),
                "tokens": float(out[2]),
                "cost_usd": float(out[3]),
                "tool_calls": float(out[4]),
            },
            _num(started) or now,
            _num(d_at),
            _str(d_by) or None if d_by is not None else None,
            _num(cancelled),
            {n[2:]: _str(v) for n, v in f.items() if n.startswith("d:")},
        )

    async def extend(
        self, key: TaskKey, rid: str, n: int, tokens: int, cost: float, now: float
    ) -> TaskAdmission | None:
        """`TaskStore.extend`. Sent twice (a dropped connection), it is applied once:
        the call's hold records the extensions it has. A caller cancelled meanwhile
        leaves what the script held in the call's hold, which its settle replaces."""
        k = self._k(key)
        args: list[str | int] = [rid, n, tokens, repr(float(cost)), self._ttl]
        out = await self._call("extend", self._extend(keys=[k, k + ":held"], args=args))
        if out is None:
            return None
        return await self._answer(k, out, now, "extend")

    async def settle(
        self, key: TaskKey, rid: str, tokens: int, cost: float, called: bool = True
    ) -> None:
        k = self._k(key)
        await self._call(
            "settle",
            self._settle(
                keys=[k, k + ":held", *self._owner_keys],
                args=[rid, tokens, repr(float(cost)), int(called), "0"],
            ),
        )

    async def release_owner(self, owner: str) -> int:
        """Settle every call `owner` left unsettled (its process died) as having used
        what it reserved, still counted as a call; return how many were released. Any
        store over the same Redis and prefix may call it; a second call finds nothing
        left."""
        okey = self._owners + owner
        held = await self._call("release_owner", self._redis.hkeys(okey))
        released = 0
        for field in held:
            k, rid = orjson.loads(field)
            settled = await self._call(
                "release_owner",
                self._settle(keys=[k, k + ":held", okey], args=[rid, 0, "0.0", 1, "1"]),
            )
            released += int(settled)
        return released

    async def unnote_results(self, key: TaskKey, call_ids: list[str]) -> None:
        await self._call(
            "unnote_results", self._unresults(keys=[self._k(key) + ":calls"], args=call_ids)
        )

    async def cancel(self, key: TaskKey, now: float) -> dict[str, Any] | None:
        at = await self._call(
            "cancel", self._cancel(keys=[self._k(key)], args=[repr(now), self._ttl])
        )
        if at is None:
            return None
        # Every other gateway process stops the task's calls it has in flight.
        await self._call("cancel", self._redis.publish(self._channel, orjson.dumps(list(key))))
        return await self.describe(key)

    async def listen(self, on_cancel: Callable[[TaskKey], Any]) -> None:
        """Call `on_cancel(key)` for each task a gateway process cancels, until
        cancelled; reconnects after Redis comes back."""

        def cancelled(data: bytes) -> None:
            try:
                tenant, task = orjson.loads(data)
            except (orjson.JSONDecodeError, ValueError, TypeError):
                return
            on_cancel((str(tenant), str(task)))

        def lost(exc: BaseException) -> None:
            log.warning("task cancel channel unavailable (%s); retrying in 1 s", exc)

        await listen(self._redis, self._channel, cancelled, on_lost=lost)

    async def note_tool_calls(self, key: TaskKey, calls: list[ToolCallNote]) -> None:
        if not calls:
            return
        k = self._k(key)
        args: list[Any] = [self._ttl, self.max_calls]
        for n in calls:
            args += [n.call_id, orjson.dumps(note_dict(n))]
        await self._call(
            "note_tool_calls",
            self._note_calls(keys=[k + ":calls", k + ":order", k], args=args),
        )

    async def note_results(self, key: TaskKey, call_ids: list[str]) -> dict[str, ToolCallNote]:
        out = await self._call(
            "note_results", self._results(keys=[self._k(key) + ":calls"], args=call_ids)
        )
        notes: dict[str, ToolCallNote] = {}
        for i in range(0, len(out), 3):
            note = _note(orjson.loads(out[i + 1]))
            note.results = int(out[i + 2])
            notes[_str(out[i])] = note
        return notes

    async def set_deployment(self, key: TaskKey, alias: str, deployment: str) -> None:
        # HSET on an existing task only (a hash made here would have no budget).
        pipe = self._redis.pipeline(transaction=True)
        k = self._k(key)
        pipe.exists(k)
        pipe.hset(k, "d:" + alias, deployment)
        exists, _ = await self._call("set_deployment", pipe.execute())
        if not exists:
            await self._call("set_deployment", self._redis.delete(k))

    async def tool_call(self, key: TaskKey, call_id: str) -> ToolCallNote | None:
        """The note with its result count (kept beside it, as `results:<id>`): what
        the tool_results stage reads to tell a new result from history."""
        raw, results = await self._call(
            "tool_call",
            self._redis.hmget(self._k(key) + ":calls", [call_id, "results:" + call_id]),
        )
        if raw is None:
            return None
        note = _note(orjson.loads(raw))
        note.results = int(results or 0)
        return note

    async def describe(self, key: TaskKey, now: float | None = None) -> dict[str, Any] | None:
        k = self._k(key)
        state = await self._call("describe", self._redis.hgetall(k))
        if not state:
            return None
        s = {_str(a): _str(b) for a, b in state.items()}
        raw_calls = await self._call("describe", self._redis.hgetall(k + ":calls"))
        counts = {
            _str(a)[8:]: int(b) for a, b in raw_calls.items() if _str(a).startswith("results:")
        }
        calls = []
        for a, b in raw_calls.items():
            if not _str(a).startswith("results:"):
                d = orjson.loads(b)
                d["results"] = counts.get(d["call_id"], 0)
                calls.append(d)
        budget = TaskBudget.of(
            {
                f: _num(s.get(src))
                for f, src in (
                    ("calls", "b_calls"),
                    ("tokens", "b_tokens"),
                    ("cost_usd", "b_cost"),
                    ("wall_s", "b_wall"),
                    ("tool_calls", "b_tools"),
                )
                if _num(s.get(src)) is not None
            }
        )
        return {
            "tenant": key[0],
            "task_id": key[1],
            "budget": budget.as_dict(),
            "used": {
                "calls": float(s["u_calls"]),
                "tokens": float(s["u_tokens"]),
                "cost_usd": round(float(s["u_cost"]), 9),
                "tool_calls": float(s.get("u_tools") or 0),
            },
            "started_at": float(s["started_at"]),
            "deadline_at": _num(s.get("deadline_at")),
            "deadline_by": s.get("deadline_by") or None,
            "refused": {a[2:]: int(b) for a, b in sorted(s.items()) if a.startswith("r_")},
            "cancelled_at": _num(s.get("cancelled_at")),
            "tool_calls": calls,
            "deployments": {a[2:]: b for a, b in s.items() if a.startswith("d:")},
        }

    async def close(self) -> None:
        if self._orphans:
            await asyncio.gather(*self._orphans, return_exceptions=True)
        await self._redis.aclose()


def _note(d: dict[str, Any]) -> ToolCallNote:
    return ToolCallNote(
        d["call_id"],
        d["tool"],
        d["class"],
        d["request_id"],
        d.get("idempotency_key"),
        d.get("results", 0),
        d.get("args_digest"),
    )

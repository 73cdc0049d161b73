"""`MemoryTaskStore`: agent tasks' state in this process (state/tasks.py; the rules in
policy/tasks.py).

Past `max_tasks` states the tenant holding the most loses its own least recently
admitted one (on a tie, the admitting tenant; among others, the greatest tenant id, as
Redis orders them), never the task being admitted: another tenant's flood of new
`x-task-id`s cannot drop a tenant's cancel or used budget (when every tenant holds one
state, the least recently admitted of all goes). Idle ones past `idle_ttl_s` go first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from switchyard.state.tasks import (
    TaskAdmission,
    TaskFirst,
    TaskKey,
    ToolCallNote,
    _State,
    check,
    check_more,
    describe_state,
    first_deadline,
)


class MemoryTaskStore:
    """Task state in this process (see the module docstring)."""

    def __init__(self, max_tasks: int = 100_000, idle_ttl_s: float = 3600.0, max_calls: int = 1000):
        self.max_tasks = max_tasks
        self.idle_ttl_s = idle_ttl_s
        self.max_calls = max_calls
        self._tasks: OrderedDict[TaskKey, _State] = OrderedDict()
        # tenant -> its tasks, least recently admitted first (the order of `_tasks`)
        self._own: dict[str, OrderedDict[TaskKey, None]] = {}

    def _drop(self, key: TaskKey) -> None:
        self._tasks.pop(key, None)
        own = self._own.get(key[0])
        if own is not None:
            own.pop(key, None)
            if not own:
                del self._own[key[0]]

    def _victim(self, keep: TaskKey) -> TaskKey:
        """The state to drop past `max_tasks` (the module docstring's rule)."""
        most = max(len(own) for own in self._own.values())
        if most < 2:  # every tenant holds one: the least recently admitted of all
            return next(k for k in self._tasks if k != keep)
        mine = self._own.get(keep[0])
        tenant = (
            keep[0]
            if mine is not None and len(mine) == most
            else max(t for t, own in self._own.items() if len(own) == most)
        )
        return next(iter(self._own[tenant]))

    def _expire(self, now: float, keep: TaskKey) -> None:
        tasks = self._tasks
        while tasks:
            key, st = next(iter(tasks.items()))
            if now - st.last_at >= self.idle_ttl_s:
                self._drop(key)
            elif len(tasks) > self.max_tasks:
                self._drop(self._victim(keep))
            else:
                break

    def _get(self, key: TaskKey, now: float) -> _State | None:
        st = self._tasks.get(key)
        if st is not None and now - st.last_at >= self.idle_ttl_s:
            self._drop(key)
            return None
        return st

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
        st = self._get(key, now)
        if st is None:
            deadline_at, by = first_deadline(first, now)
            st = self._tasks[key] = _State(first.budget, now, deadline_at, by, now)
        st.last_at = now
        self._tasks.move_to_end(key)
        own = self._own.setdefault(key[0], OrderedDict())
        own[key] = None
        own.move_to_end(key)
        self._expire(now, key)
        refused = (
            "cancelled"
            if st.cancelled_at is not None
            else check(st.budget, st.used, tokens, cost, st.deadline_at, st.deadline_by, now, tool)
        )
        if refused is None:
            st.used["tool_calls" if tool else "calls"] += 1
            st.used["tokens"] += tokens
            st.used["cost_usd"] += cost
            st.held[rid] = (tokens, cost, tool, 0)
        else:
            st.refused[refused] = st.refused.get(refused, 0) + 1
        return _answer(st, refused)

    async def extend(
        self, key: TaskKey, rid: str, n: int, tokens: int, cost: float, now: float
    ) -> TaskAdmission | None:
        st = self._tasks.get(key)
        held = st.held.get(rid) if st is not None else None
        if st is None or held is None:
            return None
        refused = None
        if held[3] < n:  # else: this extension is held already
            refused = check_more(st.budget, st.used, tokens, cost)
            if refused is None:
                st.used["tokens"] += tokens
                st.used["cost_usd"] += cost
                st.held[rid] = (held[0] + tokens, held[1] + cost, held[2], n)
        st.last_at = now
        return _answer(st, refused)

    async def settle(
        self, key: TaskKey, rid: str, tokens: int, cost: float, called: bool = True
    ) -> None:
        st = self._tasks.get(key)
        held = st.held.pop(rid, None) if st is not None else None
        if st is None or held is None:
            return
        if not called:
            kind = "tool_calls" if held[2] else "calls"
            st.used[kind] = max(0.0, st.used[kind] - 1)
        st.used["tokens"] = max(0.0, st.used["tokens"] - held[0] + tokens)
        st.used["cost_usd"] = max(0.0, st.used["cost_usd"] - held[1] + cost)

    async def cancel(self, key: TaskKey, now: float) -> dict[str, Any] | None:
        st = self._get(key, now)
        if st is None:
            return None
        if st.cancelled_at is None:
            st.cancelled_at = now
        st.last_at = now
        return describe_state(key, st)

    async def note_tool_calls(self, key: TaskKey, calls: list[ToolCallNote]) -> None:
        st = self._tasks.get(key)
        if st is None:
            return
        for note in calls:
            st.tool_calls[note.call_id] = note
            st.tool_calls.move_to_end(note.call_id)
        while len(st.tool_calls) > self.max_calls:
            st.tool_calls.popitem(last=False)

    async def note_results(self, key: TaskKey, call_ids: list[str]) -> dict[str, ToolCallNote]:
        st = self._tasks.get(key)
        out: dict[str, ToolCallNote] = {}
        if st is None:
            return out
        for cid in call_ids:
            note = st.tool_calls.get(cid)
            if note is not None:
                note.results += 1
                out[cid] = replace(note)
        return out

    async def unnote_results(self, key: TaskKey, call_ids: list[str]) -> None:
        st = self._tasks.get(key)
        if st is None:
            return
        for cid in call_ids:
            note = st.tool_calls.get(cid)
            if note is not None and note.results > 0:
                note.results -= 1

    async def tool_call(self, key: TaskKey, call_id: str) -> ToolCallNote | None:
        st = self._tasks.get(key)
        return st.tool_calls.get(call_id) if st is not None else None

    async def set_deployment(self, key: TaskKey, alias: str, deployment: str) -> None:
        st = self._tasks.get(key)
        if st is not None:
            st.deployments[alias] = deployment

    async def describe(self, key: TaskKey, now: float | None = None) -> dict[str, Any] | None:
        st = self._get(key, time.time() if now is None else now)
        return describe_state(key, st) if st is not None else None

    async def close(self) -> None:
        return None


def _answer(st: _State, refused: str | None) -> TaskAdmission:
    """The store's answer for a call of the task `st` (admitted, extended, or refused
    for `refused`)."""
    if st.budget_dict is None:
        st.budget_dict = st.budget.as_dict()
    return TaskAdmission(
        refused is None,
        refused,
        st.budget_dict,
        dict(st.used),
        st.started_at,
        st.deadline_at,
        st.deadline_by,
        st.cancelled_at,
        dict(st.deployments),
    )

"""Agent-task workloads: a small graph of dependent model and tool calls, run as one unit
of load.

What a user of an agent waits for is the task, not one call: independent steps run in
parallel, dependent ones add up, and a step that needs its predecessor's answer cannot
start on the predecessor's first token. So a step here starts only when all its parents
have finished, its prompt can quote their outputs (`{step_id}`), and steps without a
path between them run concurrently.

Each request carries `x-task-id`, its own `x-request-id` and the ids of its parents in
`x-parent-request-id`, so the gateway's task trace (observe/tasks.py) describes the same
graph. The harness computes its own view from its own timestamps:

* task E2E: from the task's first send to its last step's end;
* critical path: from the step that ended last, repeatedly step back to the parent that
  ended last (ties: earlier start, then step id); `critical_path_ms` is the sum of the
  path's request E2Es, so `task E2E - critical_path_ms` is time spent between calls;
* the task's time split along that path, as the client saw it: `model_ms` (the model
  steps' E2Es), `tool_ms` (the tool steps' E2Es) and `gap_ms` (the rest of the task's
  E2E: the client's own work between a step's parents ending and its send, and any lead
  before the path's first step), so `model_ms + tool_ms + gap_ms = task E2E`. Network
  and the gateway's own time are inside the step that paid them; the gateway's trace
  (observe/tasks.py `analyze_task`) splits them further from the server's side;
* a task is good when every planned step ran and succeeded and, if `task:MS` is given,
  its E2E is within it.

A tool step (`tool: <server>__<tool>`, `arguments: {...}`, placeholders filled in every
string of the arguments) is an MCP `tools/call` to the gateway's `/mcp` with the same
task headers (McpSession below). One MCP session serves every task of a load point: in
Switchyard the task is the request's `x-task-id`, not the session, so a session per task
would only add its handshake (two round trips) to every task's gap time, and a key may
hold only so many sessions open (api/mcp.py), which an open-loop run with many tasks in
flight would exhaust. The session is a plain-HTTP JSON-RPC client, as `bench tools`'
is: what a tool step costs the harness stays small and the same for every target.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from switchyard.bench.load import Client
from switchyard.bench.metrics import RequestRecord, Slo, stats
from switchyard.bench.workloads import RequestSpec

PLACEHOLDER = re.compile(r"\{([A-Za-z0-9_.\-]+)\}")
MCP_VERSION = "2025-11-25"
MAX_TOOL_TEXT = 100_000  # characters of a tool's result kept for later steps' placeholders
KINDS = ("model_ms", "tool_ms", "gap_ms")  # a task's E2E, split along its critical path


@dataclass(frozen=True, slots=True)
class Step:
    """A model step (`prompt`) or a tool step (`tool`, `arguments`)."""

    id: str
    prompt: str
    depends_on: tuple[str, ...] = ()
    max_tokens: int = 64
    headers: dict[str, str] = field(default_factory=dict)
    tool: str | None = None  # `<server>__<tool>`: an MCP tools/call
    arguments: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "model" if self.tool is None else "tool"

    def refs(self) -> list[str]:
        """The step ids its placeholders name (in the prompt, or the arguments' strings)."""
        if self.tool is None:
            return PLACEHOLDER.findall(self.prompt)
        return [r for text in _strings(self.arguments) for r in PLACEHOLDER.findall(text)]


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


@dataclass(frozen=True, slots=True)
class TaskGraph:
    """Steps in an order where every step comes after its parents."""

    name: str
    steps: tuple[Step, ...]


def _order(name: str, steps: list[Step]) -> tuple[Step, ...]:
    """Topological order; rejects unknown parents, cycles and placeholders that name a
    step that is not an ancestor (its output would not exist yet)."""
    by_id = {s.id: s for s in steps}
    if len(by_id) != len(steps):
        raise ValueError(f"task {name!r}: step ids must be unique")
    for s in steps:
        for p in s.depends_on:
            if p not in by_id:
                raise ValueError(f"task {name!r}: step {s.id!r} depends on unknown {p!r}")
    ordered: list[Step] = []
    ancestors: dict[str, set[str]] = {}
    pending = list(steps)
    while pending:
        ready = [s for s in pending if all(p in ancestors for p in s.depends_on)]
        if not ready:
            raise ValueError(f"task {name!r}: the steps form a cycle")
        for s in ready:
            ancestors[s.id] = set(s.depends_on).union(*(ancestors[p] for p in s.depends_on))
            for ref in s.refs():
                if ref in by_id and ref not in ancestors[s.id]:
                    raise ValueError(
                        f"task {name!r}: step {s.id!r} quotes {{{ref}}}, which is not "
                        "one of its ancestors"
                    )
            ordered.append(s)
            pending.remove(s)
    return tuple(ordered)


def parse_graphs(data: Any, default_name: str, default_max_tokens: int = 64) -> list[TaskGraph]:
    """`{steps: [...]}` (one task) or `{tasks: [{name, steps}, ...]}`."""
    if not isinstance(data, dict):
        raise ValueError("an agent task file holds a mapping with 'steps' or 'tasks'")
    raw_tasks = data.get("tasks") or [{"name": data.get("name", default_name), **data}]
    graphs = []
    for i, t in enumerate(raw_tasks):
        name = str(t.get("name") or f"{default_name}-{i}")
        steps = [_step(name, s, default_max_tokens) for s in t.get("steps") or []]
        if not steps:
            raise ValueError(f"task {name!r} has no steps")
        graphs.append(TaskGraph(name, _order(name, steps)))
    return graphs


def _step(task: str, s: Any, default_max_tokens: int) -> Step:
    if not isinstance(s, dict) or "id" not in s:
        raise ValueError(f"task {task!r}: each step is a mapping with an 'id'")
    sid = str(s["id"])
    if ("prompt" in s) == ("tool" in s):
        raise ValueError(f"task {task!r}: step {sid!r} needs either 'prompt' or 'tool'")
    arguments = s.get("arguments") or {}
    if "tool" in s:
        tool = s["tool"]
        if not isinstance(tool, str) or not tool or not isinstance(arguments, dict):
            raise ValueError(
                f"task {task!r}: step {sid!r}: 'tool' names <server>__<tool> and "
                "'arguments' is a mapping"
            )
    elif "arguments" in s:
        raise ValueError(f"task {task!r}: step {sid!r}: 'arguments' belong to a tool step")
    return Step(
        id=sid,
        prompt=str(s.get("prompt", "")),
        depends_on=tuple(str(p) for p in s.get("depends_on") or ()),
        max_tokens=int(s.get("max_tokens") or default_max_tokens),
        headers={str(k): str(v) for k, v in (s.get("headers") or {}).items()},
        tool=str(s["tool"]) if "tool" in s else None,
        arguments=dict(arguments),
    )


def load_graphs(path: str, default_max_tokens: int = 64) -> list[TaskGraph]:
    """Read a YAML or JSON task file (JSON is YAML)."""
    return parse_graphs(yaml.safe_load(Path(path).read_text()), Path(path).stem, default_max_tokens)


def fill(prompt: str, outputs: dict[str, str]) -> str:
    """Replace `{step_id}` by that step's output; other braces stay as they are."""
    return PLACEHOLDER.sub(lambda m: outputs.get(m.group(1), m.group(0)), prompt)


def fill_arguments(value: Any, outputs: dict[str, str]) -> Any:
    """`fill` applied to every string in a tool step's arguments (keys stay as written)."""
    if isinstance(value, str):
        return fill(value, outputs)
    if isinstance(value, dict):
        return {k: fill_arguments(v, outputs) for k, v in value.items()}
    if isinstance(value, list):
        return [fill_arguments(v, outputs) for v in value]
    return value


@dataclass(slots=True)
class ToolRecord:
    """One tool step as the harness saw it: an MCP tools/call's send and answer."""

    index: int
    request_id: str  # the gateway's (its result's `_meta`), else the harness's own
    step_id: str
    tool: str
    sent_s: float = 0.0
    end_s: float | None = None
    ok: bool = False
    error: str | None = None  # http_<status>, jsonrpc_<code>, tool_error, timeout, ...
    error_code: str | None = None  # the JSON-RPC error's `data.code`, when it has one
    warmup: bool = False
    task_id: str | None = None
    parent_request_ids: list[str] = field(default_factory=list)
    text: str = ""  # the result's text content, for later steps' placeholders

    @property
    def e2e_ms(self) -> float | None:
        return None if self.end_s is None else (self.end_s - self.sent_s) * 1000

    def to_json(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__slots__ if f != "text"}
        d["output_chars"] = len(self.text)
        d["e2e_ms"] = self.e2e_ms
        return d


class McpSession:
    """One MCP session (Streamable HTTP, plain JSON-RPC over the load point's HTTP
    client), opened at the first tool step and shared by every task (see the module
    docstring for why not one per task)."""

    def __init__(self, client: Client, url: str) -> None:
        self.client = client
        self.url = url
        self.headers = {
            "accept": "application/json, text/event-stream",
            "content-type": "application/json",
        }
        if client.target.api_key:
            self.headers["authorization"] = f"Bearer {client.target.api_key}"
        self._next_id = 0
        self._open: asyncio.Task[str | None] | None = None

    async def _post(self, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, Any, str]:
        """(HTTP status, the JSON-RPC reply or None, the session id header or "")."""
        session = self.client.session
        assert session is not None, "use the client as an async context manager"
        async with session.post(self.url, data=orjson.dumps(body), headers=headers) as resp:
            raw = await resp.read()
            sid = resp.headers.get("mcp-session-id", "")
            if resp.content_type == "text/event-stream":  # a server that streams replies
                lines = [x[5:] for x in raw.splitlines() if x.startswith(b"data:")]
                raw = lines[-1] if lines else b""
            try:
                reply = orjson.loads(raw) if raw.strip() else None
            except orjson.JSONDecodeError:
                reply = None
            return resp.status, reply, sid

    async def _handshake(self) -> str | None:
        """Initialize the session; None when it worked, else why not."""
        init = {
            "jsonrpc": "2.0",
            "id": 0,
            "method": "initialize",
            "params": {
                "protocolVersion": MCP_VERSION,
                "capabilities": {},
                "clientInfo": {"name": "switchyard-bench-agent", "version": "1"},
            },
        }
        try:
            status, reply, sid = await self._post(init, self.headers)
            if status != 200 or not isinstance(reply, dict) or "result" not in reply:
                return f"initialize: HTTP {status}"
            if sid:
                self.headers["mcp-session-id"] = sid
            self.headers["mcp-protocol-version"] = MCP_VERSION
            note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
            await self._post(note, self.headers)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"initialize: {type(exc).__name__}"
        return None

    async def call(
        self, tool: str, arguments: dict[str, Any], rec: ToolRecord, headers: dict[str, str]
    ) -> None:
        """One tools/call; fills `rec` in and never raises for the call's failures."""
        if self._open is None:
            self._open = asyncio.ensure_future(self._handshake())
        why = await asyncio.shield(self._open)
        self._next_id += 1
        # Each call has its own id, as a model-proposed call does: a side-effecting
        # tool is then recorded at most once by the gateway.
        params = {
            "name": tool,
            "arguments": arguments,
            "_meta": {"call_id": f"call_sy_bench{uuid.uuid4().hex}"},
        }
        body = {"jsonrpc": "2.0", "id": self._next_id, "method": "tools/call", "params": params}
        rec.sent_s = self.client.clock.now()
        if why is not None:
            rec.error, rec.end_s = "mcp_session", rec.sent_s
            return
        try:
            status, reply, _ = await self._post(body, self.headers | headers)
            _fill_tool_record(rec, status, reply)
        except TimeoutError:
            rec.error = "timeout"
        except aiohttp.ClientConnectorError:
            rec.error = "connect"
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError):
            rec.error = "disconnect"
        except aiohttp.ClientError as exc:
            rec.error = f"client_error: {type(exc).__name__}"
        rec.end_s = self.client.clock.now()
        rec.ok = rec.error is None


def _fill_tool_record(rec: ToolRecord, status: int, reply: Any) -> None:
    if not isinstance(reply, dict):
        rec.error = f"http_{status}" if status != 200 else "bad_reply"
        return
    error = reply.get("error")
    if isinstance(error, dict):
        rec.error = f"jsonrpc_{error.get('code')}"
        data = error.get("data")
        code = data.get("code") if isinstance(data, dict) else None
        rec.error_code = code if isinstance(code, str) else None
        return
    result = reply.get("result")
    if status != 200 or not isinstance(result, dict):
        rec.error = f"http_{status}" if status != 200 else "bad_reply"
        return
    meta = result.get("_meta")
    gateway_id = meta.get("switchyard/request_id") if isinstance(meta, dict) else None
    if isinstance(gateway_id, str):
        rec.request_id = gateway_id
    parts = result.get("content")
    texts = [
        p["text"]
        for p in (parts if isinstance(parts, list) else [])
        if isinstance(p, dict) and isinstance(p.get("text"), str)
    ]
    rec.text = "\n".join(texts)[:MAX_TOOL_TEXT]
    if result.get("isError"):
        rec.error = "tool_error"


Executed = RequestRecord | ToolRecord


@dataclass(slots=True)
class TaskRecord:
    """One executed task: its steps' records and the harness's view of its timing."""

    task_id: str
    name: str
    index: int
    warmup: bool
    scheduled_s: float | None
    steps_planned: int
    records: dict[str, RequestRecord] = field(default_factory=dict)  # model steps, by id
    parents: dict[str, tuple[str, ...]] = field(default_factory=dict)
    tool_records: dict[str, ToolRecord] = field(default_factory=dict)  # tool steps, by id

    def executed(self) -> dict[str, Executed]:
        """Every step that was sent, model and tool, by step id."""
        return {**self.records, **self.tool_records}

    @property
    def ok(self) -> bool:
        steps = self.executed()
        return len(steps) == self.steps_planned and all(r.ok for r in steps.values())

    @property
    def start_s(self) -> float | None:
        return min((r.sent_s for r in self.executed().values()), default=None)

    @property
    def end_s(self) -> float | None:
        ends = (r.end_s for r in self.executed().values() if r.end_s is not None)
        return max(ends, default=None)

    @property
    def e2e_ms(self) -> float | None:
        start, end = self.start_s, self.end_s
        return None if start is None or end is None else (end - start) * 1000

    def critical_path(self) -> tuple[list[str], float]:
        """Step ids first to last, and the sum of their E2Es in ms."""
        done = {k: r for k, r in self.executed().items() if r.end_s is not None}
        if not done:
            return [], 0.0

        def latest(ids: list[str]) -> str:
            return min(ids, key=lambda k: (-(done[k].end_s or 0.0), done[k].sent_s, k))

        path = [latest(list(done))]
        while parents := [p for p in self.parents.get(path[-1], ()) if p in done]:
            path.append(latest(parents))
        path.reverse()
        return path, sum(done[k].e2e_ms or 0.0 for k in path)

    def time_split(self) -> dict[str, float]:
        """The task's E2E along its critical path: model steps, tool steps, and the gaps
        (everything else), so the three add up to the task's E2E."""
        path, _ = self.critical_path()
        model = sum(self.records[k].e2e_ms or 0.0 for k in path if k in self.records)
        tool = sum(self.tool_records[k].e2e_ms or 0.0 for k in path if k in self.tool_records)
        e2e = self.e2e_ms or 0.0
        return {"model_ms": model, "tool_ms": tool, "gap_ms": max(0.0, e2e - model - tool)}

    def to_json(self) -> dict[str, Any]:
        path, path_ms = self.critical_path()
        return {
            "task_id": self.task_id,
            "name": self.name,
            "index": self.index,
            "warmup": self.warmup,
            "ok": self.ok,
            "scheduled_s": self.scheduled_s,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "e2e_ms": self.e2e_ms,
            "steps_planned": self.steps_planned,
            "steps_executed": len(self.executed()),
            "critical_path": path,
            "critical_path_ms": path_ms,
            **self.time_split(),
            "steps": {k: r.request_id for k, r in self.executed().items()},
            "tool_steps": {k: r.to_json() for k, r in self.tool_records.items()},
        }


async def run_task(
    client: Client,
    graph: TaskGraph,
    task: TaskRecord,
    next_index: Callable[[], int],
    mcp: McpSession | None = None,
) -> None:
    """Run every step once its parents are done; a failed parent skips its dependents.
    Tool steps go through `mcp` (required when the graph has any)."""
    futures: dict[str, asyncio.Future[Executed | None]] = {}
    outputs: dict[str, str] = {}
    if mcp is None and any(s.tool is not None for s in graph.steps):
        raise ValueError(f"task {graph.name!r} has tool steps: it needs an MCP session")

    async def run_step(step: Step) -> Executed | None:
        parents = [await futures[p] for p in step.depends_on]
        if any(p is None or not p.ok for p in parents):
            return None
        parent_ids = [p.request_id for p in parents if p is not None]
        headers = {"x-task-id": task.task_id, "x-task-planned-steps": str(task.steps_planned)}
        if parent_ids:
            headers["x-parent-request-id"] = ",".join(parent_ids)
        if step.tool is not None:
            assert mcp is not None
            tool = ToolRecord(
                index=next_index(),
                request_id=f"bench-{uuid.uuid4().hex[:16]}",
                step_id=step.id,
                tool=step.tool,
                warmup=task.warmup,
                task_id=task.task_id,
                parent_request_ids=parent_ids,
            )
            task.tool_records[step.id] = tool
            arguments = fill_arguments(step.arguments, outputs)
            await mcp.call(step.tool, arguments, tool, headers | step.headers)
            outputs[step.id] = tool.text
            return tool
        rec = RequestRecord(
            index=next_index(),
            request_id=f"bench-{uuid.uuid4().hex[:16]}",
            sent_s=0.0,
            # Root steps go out at the task's scheduled time, so their send lag is the
            # harness's; later steps wait on their parents by design.
            scheduled_s=None if step.depends_on else task.scheduled_s,
            warmup=task.warmup,
            task_id=task.task_id,
            step_id=step.id,
            parent_request_ids=parent_ids,
        )
        spec = RequestSpec(
            [{"role": "user", "content": fill(step.prompt, outputs)}], step.max_tokens
        )
        task.records[step.id] = rec
        await client.send(spec, rec, headers | step.headers)
        outputs[step.id] = rec.text
        return rec

    for step in graph.steps:  # parents first, so their futures exist
        task.parents[step.id] = step.depends_on
        futures[step.id] = asyncio.ensure_future(run_step(step))
    await asyncio.gather(*futures.values())


def summarize_tasks(tasks: list[TaskRecord], slo: Slo) -> dict[str, Any]:
    """Task-level summary of one load point; warm-up tasks are left out."""
    measured = [t for t in tasks if not t.warmup]
    ok = [t for t in measured if t.ok]
    calls = [c for t in measured for c in t.tool_records.values()]
    starts = [s for t in measured if (s := t.start_s) is not None]
    ends = [e for t in measured if (e := t.end_s) is not None]
    window = max(ends) - min(starts) if starts and ends else 0.0
    good = [t for t in ok if slo.task_ms is None or (t.e2e_ms or 0.0) <= slo.task_ms]
    return {
        "tasks": len(measured),
        "completed": len(ok),
        "failed": len(measured) - len(ok),
        "duration_s": window,
        "task_throughput": len(ok) / window if window > 0 else None,
        "tasks_within_slo": len(good),
        "tasks_within_slo_per_s": len(good) / window if window > 0 else None,
        "steps_planned": sum(t.steps_planned for t in measured),
        "steps_executed": sum(len(t.executed()) for t in measured),
        "task_e2e_ms": stats([t.e2e_ms for t in ok if t.e2e_ms is not None]),
        "critical_path_ms": stats([t.critical_path()[1] for t in ok]),
        **_split_summary(ok),
        "tool_calls": {
            "n": len(calls),
            "failed": sum(1 for c in calls if not c.ok),
            "errors": _count(c.error for c in calls if c.error is not None),
            "e2e_ms": stats([e for c in calls if c.ok and (e := c.e2e_ms) is not None]),
        },
    }


def _split_summary(ok: list[TaskRecord]) -> dict[str, Any]:
    """Per-task model, tool and gap time (stats over completed tasks), and each one's
    share of their summed E2E."""
    splits = [t.time_split() for t in ok]
    total = sum(t.e2e_ms or 0.0 for t in ok)
    out: dict[str, Any] = {k: stats([s[k] for s in splits]) for k in KINDS}
    out["time_share"] = {
        k.removesuffix("_ms"): (sum(s[k] for s in splits) / total if total > 0 else None)
        for k in KINDS
    }
    return out


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out

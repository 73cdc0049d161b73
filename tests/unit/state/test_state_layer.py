"""The state layer's structure: each store interface (a Protocol in state/) is met by
every implementation beside it, nothing in state/ imports the layers above it, no module
above it only re-exports its names (an old path that makes the layout lie), and
state/choose.py picks memory, SQL or Redis from settings."""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import pkgutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

import switchyard.state
from switchyard.config import Settings, parse_settings, store_target
from switchyard.decide.balance import Balancer
from switchyard.decide.cache import ResponseCache
from switchyard.identity import TaskBudget
from switchyard.state import choose
from switchyard.state.approvals import Approvals, ApprovalStore
from switchyard.state.breakers import SharedBreakerState
from switchyard.state.breakers_redis import SharedBreakers
from switchyard.state.cache import CacheShare, LocalEntries
from switchyard.state.cache_redis import SharedCache
from switchyard.state.guard import GuardShare, GuardSource
from switchyard.state.guard_redis import SharedGuard
from switchyard.state.idempotency import Idempotency, IdempotencyStore
from switchyard.state.keys import Keys, KeyStore
from switchyard.state.ledger import UsageLedger
from switchyard.state.limits import Ask, Limiter, LimiterUnavailable, ScopeLimits
from switchyard.state.limits_memory import MemoryLimiter
from switchyard.state.limits_redis import RedisLimiter
from switchyard.state.responses import Responses, ResponseStore
from switchyard.state.responses import Sealer as ResponsesSealer
from switchyard.state.sealing import Sealer
from switchyard.state.store import Ledger, MemoryLedger, MemoryStore, SqliteStore, Store
from switchyard.state.tasks import TaskFirst, TaskStore
from switchyard.state.tasks_memory import MemoryTaskStore
from switchyard.state.tasks_redis import RedisTaskStore
from switchyard.state.tool_calls import Sealer as ToolCallSealer
from switchyard.state.tool_calls import ToolCallRecords, ToolCalls

# Every interface in state/ and the implementations beside it. `Store` is a base class
# whose methods the two stores override; the others are Protocols.
IMPLEMENTED: dict[type, list[type]] = {
    Limiter: [MemoryLimiter, RedisLimiter],
    TaskStore: [MemoryTaskStore, RedisTaskStore],
    SharedBreakerState: [SharedBreakers],
    Ledger: [UsageLedger, MemoryLedger],
    ToolCallSealer: [Sealer, ResponsesSealer],
    Store: [SqliteStore, MemoryStore],
    # One SQL implementation each, on SQLite, PostgreSQL or an in-memory database.
    Keys: [KeyStore],
    Idempotency: [IdempotencyStore],
    Approvals: [ApprovalStore],
    ToolCalls: [ToolCallRecords],
    Responses: [ResponseStore],
    # The memory side of the cache entries is the response cache itself (decide/).
    LocalEntries: [ResponseCache],
    CacheShare: [SharedCache],
    # A canary guard's window is the balancer's (decide/); what shares it is Redis's.
    GuardShare: [SharedGuard],
    GuardSource: [Balancer],
}

# Unreachable on purpose: a Redis implementation must construct without connecting.
NO_REDIS = "redis://127.0.0.1:1/0"
ABOVE_STATE = ("policy", "decide", "execute", "observe", "media", "api", "gateway", "service")


def _state_modules() -> list[str]:
    return [f"switchyard.state.{m.name}" for m in pkgutil.iter_modules(switchyard.state.__path__)]


def _members(interface: type) -> dict[str, Any]:
    """The interface's own public members (methods and properties)."""
    return {
        name: value
        for name, value in vars(interface).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }


def _shape(member: Any) -> tuple[str, list[tuple[str, Any, Any]]]:
    """What kind of member it is and its parameters (name, kind, default)."""
    if isinstance(member, property):
        return "property", []
    kind = "coroutine" if inspect.iscoroutinefunction(member) else "function"
    params = [(p.name, p.kind, p.default) for p in inspect.signature(member).parameters.values()]
    return kind, params


def test_every_protocol_in_state_is_checked_here() -> None:
    found = set()
    for name in _state_modules():
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and value.__module__ == name
                and getattr(value, "_is_protocol", False)
            ):
                found.add(value)
    assert found, "state/ defines no Protocol"
    assert found <= set(IMPLEMENTED), f"Protocols without implementations listed: {found}"


@pytest.mark.parametrize(
    ("interface", "impl"),
    [(i, c) for i, impls in IMPLEMENTED.items() for c in impls],
    ids=lambda t: t.__name__,
)
def test_each_implementation_has_the_interface_methods_and_signatures(
    interface: type, impl: type
) -> None:
    members = _members(interface)
    assert members, f"{interface.__name__} declares nothing"
    for name, member in members.items():
        assert hasattr(impl, name), f"{impl.__name__} lacks {interface.__name__}.{name}"
        want = _shape(member)
        got = _shape(inspect.getattr_static(impl, name))
        if want[0] == "function" and inspect.signature(member).return_annotation == "Any":
            got = (want[0], got[1])  # "may be a coroutine" (Limiter.seed_spent)
        assert got == want, f"{impl.__name__}.{name}: {got} != {interface.__name__}'s {want}"


def test_runtime_checkable_protocols_accept_their_implementations() -> None:
    breakers = SharedBreakers(NO_REDIS, 0.1)
    assert isinstance(breakers, SharedBreakerState)
    assert not isinstance(MemoryLimiter(), SharedBreakerState)
    asyncio.run(breakers.close())


def test_nothing_in_state_imports_a_layer_above_it() -> None:
    for name in _state_modules():
        path = Path(importlib.import_module(name).__file__ or "")
        for node in ast.walk(ast.parse(path.read_text())):
            mods = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for mod in mods:
                parts = mod.split(".")
                assert not (
                    parts[0] == "switchyard" and len(parts) > 1 and parts[1] in ABOVE_STATE
                ), f"{name} imports {mod}"


def _reexports_state_only(tree: ast.Module) -> bool:
    """Whether a module holds nothing but imports from state/ (beside its docstring,
    `from __future__` and `__all__`)."""
    sources = []
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"]:
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if not isinstance(node, ast.ImportFrom):
            return False
        sources.append(node.module or "")
    return bool(sources) and all(m.startswith("switchyard.state.") for m in sources)


def test_no_module_above_state_only_reexports_its_names() -> None:
    package = Path(switchyard.state.__file__ or "").parent.parent
    faces = {
        ".".join(("switchyard", *path.relative_to(package).with_suffix("").parts))
        for path in package.rglob("*.py")
        if path.parent.name != "state" and _reexports_state_only(ast.parse(path.read_text()))
    }
    assert faces == set()  # each name is imported from where it is defined


def _settings(tmp: Path, backend: str = "sqlite", redis_url: str | None = None) -> Settings:
    return parse_settings(
        {
            "models": [
                {"alias": "m", "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"}}
            ],
            "embeddings": {"enabled": False},
            "storage": {
                "backend": backend,
                "sqlite_path": str(tmp / "gw.db"),
                "redis_url": redis_url,
                "redis_timeout_s": 0.2,
            },
        }
    )


def test_memory_backend_chooses_the_in_memory_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SWITCHYARD_SQLITE_PATH", raising=False)
    s = _settings(tmp_path, backend="memory")
    store = choose.build_store(s, store_target(s))
    try:
        assert type(store) is MemoryStore
        assert not (tmp_path / "gw.db").exists()  # no file opened
    finally:
        store.close()


def test_sqlite_backend_chooses_the_sql_store_on_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SWITCHYARD_SQLITE_PATH", raising=False)
    s = _settings(tmp_path)
    store = choose.build_store(s, store_target(s))
    try:
        assert type(store) is SqliteStore
        with store.connection() as conn:
            assert isinstance(conn, sqlite3.Connection)
        assert (tmp_path / "gw.db").exists()
    finally:
        store.close()


def test_without_redis_limits_and_tasks_stay_in_memory(tmp_path: Path) -> None:
    s = _settings(tmp_path, backend="memory")
    assert type(choose.build_limiter(s)) is MemoryLimiter
    tasks = choose.build_tasks(s)
    assert type(tasks) is MemoryTaskStore
    assert tasks.max_tasks == s.tasks.max_tasks
    assert tasks.idle_ttl_s == s.tasks.idle_ttl_s
    assert choose.build_shared_breakers(s) is None  # each process's breakers are its own


def test_with_redis_limits_and_tasks_go_to_redis_without_connecting(tmp_path: Path) -> None:
    s = _settings(tmp_path, backend="memory", redis_url=NO_REDIS)
    limiter = choose.build_limiter(s)  # nothing listens there: building must not connect
    tasks = choose.build_tasks(s)
    assert type(limiter) is RedisLimiter
    assert type(tasks) is RedisTaskStore
    assert type(choose.build_shared_breakers(s)) is SharedBreakers

    async def use() -> tuple[BaseException | None, BaseException | None]:
        scope = ScopeLimits("key:k", rpm=1)
        got = []
        for call in (
            limiter.reserve([scope], Ask("r1", 1, 0.0)),
            tasks.admit(("t", "task"), TaskFirst(TaskBudget(calls=1)), "r1", 1, 0.0, 0.0),
        ):
            try:
                await call
                got.append(None)
            except LimiterUnavailable as exc:
                got.append(exc)
        await tasks.close()
        return got[0], got[1]

    limiter_error, tasks_error = asyncio.run(use())
    # The first use is what reaches Redis: both report it unavailable, by its state.
    assert limiter_error is not None and "Redis limiter unavailable" in str(limiter_error)
    assert tasks_error is not None and "Redis task state unavailable" in str(tasks_error)


def test_a_shared_components_redis_failures_are_counted_and_logged_sparingly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from switchyard.state.redis import count_failure

    log = logging.getLogger("switchyard.test-failures")
    errors = 0
    with caplog.at_level(logging.WARNING, logger=log.name):
        for _ in range(250):
            errors = count_failure(log, errors, "shared thing", OSError("down"))
    assert errors == 250
    logged = [r.getMessage() for r in caplog.records if r.name == log.name]
    assert logged == [f"shared thing failed ({n} so far): down" for n in (1, 100, 200)]

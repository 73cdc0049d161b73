"""The private redis-server of `serve --workers N` (scale/private_redis.py), and the
release of a dead worker's holds in the shared limiter and task store
(`release_owner` in state/limits_redis.py and state/tasks_redis.py).

Everything runs against real redis-server processes: the private one under a
temporary home, and for the owners' holds a throwaway one on loopback (as the other
Redis tests), each test under its own key prefix.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis as AsyncRedis

from switchyard.config.settings import load_settings
from switchyard.scale.private_redis import PrivateRedis, PrivateRedisError, gateway_home
from switchyard.state.limits import Ask, ScopeLimits
from switchyard.state.limits_redis import RedisLimiter
from switchyard.state.redis import REDIS_PASSWORD_ENV, redis_client
from switchyard.state.tasks import TaskBudget, TaskFirst
from switchyard.state.tasks_redis import RedisTaskStore

T0 = 1_750_000_000.0  # 2025-06-15 15:06:40 UTC: far from a day boundary


@pytest.fixture
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Short: a Unix socket path holds at most 107 bytes.
    return tmp_path_factory.mktemp("home")


@pytest.fixture
def private(home: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(home)
    yield server
    server.stop()


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


def ask(rid: str, tokens: int = 1, cost: float = 0.0) -> Ask:
    return Ask(request_id=rid, tokens=tokens, cost_usd=cost)


# -- the private redis-server ---------------------------------------------------------------


def test_private_redis_serves_only_a_private_unix_socket(private: PrivateRedis) -> None:
    url = private.start()
    assert url == f"unix://{private.socket_path}" and private.alive()
    assert stat.S_IMODE(private.run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(private.socket_path.stat().st_mode) == 0o600
    client = redis.Redis.from_url(url)
    try:
        config = client.config_get("*")
    finally:
        client.close()
    assert config["port"] == "0"  # no TCP listener
    assert (config["save"], config["appendonly"], config["daemonize"]) == ("", "no", "no")

    async def limited() -> tuple[bool, bool]:
        lim = RedisLimiter(url, prefix="t:")
        try:
            sc = [ScopeLimits("key:k", max_concurrency=1)]
            first = await lim.reserve(sc, ask("a"), now=T0)
            second = await lim.reserve(sc, ask("b"), now=T0)
            return first.allowed, second.allowed
        finally:
            await lim.close()

    assert asyncio.run(limited()) == (True, False)
    private.stop()
    assert not private.alive() and not private.socket_path.exists()


def test_a_stale_socket_does_not_block_start(private: PrivateRedis) -> None:
    """A crashed run's socket file, bound but no longer served, is replaced."""
    private.run_dir.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(private.socket_path))
    stale.close()  # the file stays, nothing listens
    assert private.socket_path.exists()
    client = redis.Redis.from_url(private.start())
    try:
        assert client.ping()
    finally:
        client.close()


def test_a_socket_still_served_is_not_taken(private: PrivateRedis, home: Path) -> None:
    private.start()
    with pytest.raises(PrivateRedisError, match="another gateway"):
        PrivateRedis(home).start()
    assert private.alive()


def test_restart_after_a_crash_serves_the_same_url(private: PrivateRedis) -> None:
    url = private.start()
    first = private.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)  # leaves its socket file behind
    deadline = time.monotonic() + 10
    while private.alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not private.alive() and private.socket_path.exists()
    assert private.restart() == url and private.pid != first
    client = redis.Redis.from_url(url)
    try:
        assert client.ping()
    finally:
        client.close()


def test_the_state_layer_password_is_required(
    private: PrivateRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With $SWITCHYARD_REDIS_PASSWORD set, every state client sends it; the private
    server requires it (and the command line does not show it)."""
    monkeypatch.setenv(REDIS_PASSWORD_ENV, "s3cret word")
    url = private.start()
    assert b"s3cret" not in Path(f"/proc/{private.pid}/cmdline").read_bytes()

    async def pings() -> tuple[bool, bool]:
        with_password = redis_client(url, 2.0)
        without = AsyncRedis.from_url(url)
        try:
            ok = bool(await with_password.ping())
            try:
                await without.ping()
                refused = False
            except redis.exceptions.AuthenticationError:
                refused = True
            return ok, refused
        finally:
            await with_password.aclose()
            await without.aclose()

    assert asyncio.run(pings()) == (True, True)


def test_a_missing_or_failing_server_is_named(home: Path) -> None:
    with pytest.raises(PrivateRedisError, match="not-a-redis-server is not installed"):
        PrivateRedis(home, binary="not-a-redis-server").start()
    with pytest.raises(PrivateRedisError, match="exited with code 1 at start"):
        PrivateRedis(home, binary="false").start()


def test_gateway_home_is_the_directory_of_the_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SWITCHYARD_SQLITE_PATH", raising=False)
    default = load_settings(None)
    storage = default.storage.model_copy(update={"sqlite_path": str(tmp_path / "gw" / "s.db")})
    settings = default.model_copy(update={"storage": storage})
    assert gateway_home(settings) == tmp_path.resolve() / "gw"
    assert gateway_home(settings, str(tmp_path / "o" / "x.db")) == tmp_path.resolve() / "o"
    with pytest.raises(PrivateRedisError, match="longer than a Unix socket allows"):
        PrivateRedis(tmp_path / ("d" * 120))


# -- a dead worker's holds ------------------------------------------------------------------

KEY = ScopeLimits("key:k", rpm=10, tpm=150, max_concurrency=1)
TENANT = ScopeLimits("tenant:t", budget_usd=1.0)


def test_release_owner_frees_a_dead_workers_holds(redis_url: str, prefix: str) -> None:
    async def body() -> None:
        worker = RedisLimiter(redis_url, prefix=prefix, owner="w1")
        supervisor = RedisLimiter(redis_url, prefix=prefix)
        try:
            assert (await worker.reserve([KEY, TENANT], ask("a", 100, 0.6), now=T0)).allowed
            # The worker dies here. Until its holds are released, nothing more fits:
            refused = [
                await supervisor.reserve([KEY], ask("b", 1), now=T0 + 1),
                await supervisor.reserve([ScopeLimits("key:k", tpm=150)], ask("c", 100), T0 + 1),
                await supervisor.reserve([TENANT], ask("d", 1, 0.6), now=T0 + 1),
            ]
            assert [v.limit for v in refused] == ["concurrency", "tpm", "budget"]

            assert await supervisor.release_owner("w1", now=T0 + 2) == 1
            # Its slot is back, but what it reserved stays used (it may have been spent):
            # its 100 tokens stay in the tpm window, its $0.6 in the budget.
            assert not (await supervisor.reserve([KEY], ask("x", 51), now=T0 + 3)).allowed
            again = await supervisor.reserve([KEY, TENANT], ask("e", 49, 0.4), now=T0 + 3)
            assert again.allowed
            # The dead request stays in its requests window (a and e are in it; the
            # refused x is not).
            assert again.state["key:k"]["remaining_requests"] == 10 - 2
            # What was left before e: the budget less a's reservation.
            assert again.state["tenant:t"]["budget_remaining_usd"] == pytest.approx(0.4)

            # Twice, or a late settle by the worker itself: nothing more is released.
            assert await supervisor.release_owner("w1", now=T0 + 4) == 0
            await worker.settle([KEY, TENANT], ask("a", 100, 0.6), 0, 0.0, now=T0 + 4)
            late = await supervisor.reserve([KEY, TENANT], ask("f", 1, 0.0), now=T0 + 5)
            assert (late.allowed, late.limit) == (False, "concurrency")
            assert late.state["tenant:t"]["budget_remaining_usd"] == pytest.approx(0.0)
        finally:
            await worker.close()
            await supervisor.close()

    asyncio.run(body())


def test_release_owner_leaves_settled_holds_and_other_owners(redis_url: str, prefix: str) -> None:
    """What the worker settled stays charged at its real cost; two workers given the
    same client request id each settle their own hold."""
    two = ScopeLimits("key:k", max_concurrency=2)

    async def body() -> None:
        w1 = RedisLimiter(redis_url, prefix=prefix, owner="w1")
        w2 = RedisLimiter(redis_url, prefix=prefix, owner="w2")
        try:
            assert (await w1.reserve([TENANT], ask("a", 1, 0.5), now=T0)).allowed
            assert (await w1.reserve([TENANT], ask("b", 1, 0.5), now=T0)).allowed
            await w1.settle([TENANT], ask("a", 1, 0.5), 1, 0.2, now=T0 + 1)
            assert (await w1.reserve([two], ask("same"), now=T0)).allowed
            assert (await w2.reserve([two], ask("same"), now=T0)).allowed
            await w2.settle([two], ask("same"), 1, 0.0, now=T0 + 1)

            assert await w2.release_owner("w1", now=T0 + 2) == 2  # b, and its "same"
            probe = await w2.reserve([TENANT, two], ask("p", 1, 0.0), now=T0 + 3)
            assert probe.allowed
            assert probe.state["tenant:t"]["budget_remaining_usd"] == pytest.approx(0.3)
            assert (await w2.reserve([two], ask("q"), now=T0 + 3)).allowed  # both slots were free
        finally:
            await w1.close()
            await w2.close()

    asyncio.run(body())


def test_without_an_owner_nothing_is_recorded(redis_url: str, prefix: str) -> None:
    async def body() -> None:
        lim = RedisLimiter(redis_url, prefix=prefix)
        try:
            assert (await lim.reserve([KEY], ask("a"), now=T0)).allowed
            assert await lim.release_owner("w1", now=T0 + 1) == 0
            assert not (await lim.reserve([KEY], ask("b"), now=T0 + 1)).allowed
        finally:
            await lim.close()

    asyncio.run(body())
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.keys(f"{prefix}*owner*") == []
    finally:
        client.close()


def test_release_owner_keeps_a_dead_workers_task_reservations_spent(
    redis_url: str, prefix: str
) -> None:
    """A call in flight when its worker died may have gone upstream: the task keeps
    what it reserved as spent (its budget is never passed), and it still counts."""
    key = ("acme", "agent-1")
    first = TaskFirst(TaskBudget(tokens=1000, cost_usd=1.0))

    async def body() -> None:
        worker = RedisTaskStore(redis_url, prefix=prefix, owner="w1")
        supervisor = RedisTaskStore(redis_url, prefix=prefix)
        try:
            assert (await worker.admit(key, first, "r1", 600, 0.6, T0)).allowed
            assert (await worker.admit(key, first, "r2", 100, 0.1, T0)).allowed
            await worker.settle(key, "r2", 50, 0.05)
            # The worker dies with r1 in flight.
            assert (await supervisor.admit(key, first, "r3", 600, 0.6, T0 + 1)).refused == "tokens"

            assert await supervisor.release_owner("w1") == 1
            # r1's 600 tokens stay spent: r4 does not fit, a smaller call does.
            assert (await supervisor.admit(key, first, "r4", 600, 0.6, T0 + 2)).refused
            assert (await supervisor.admit(key, first, "r5", 300, 0.3, T0 + 2)).allowed
            assert await supervisor.release_owner("w1") == 0
            await worker.settle(key, "r1", 0, 0.0)  # too late: nothing held, nothing back
            state = await supervisor.describe(key)
            assert state is not None
            # r1 still counts as a call, at what it reserved; r5 holds its reservation.
            assert state["used"]["calls"] == 3
            assert state["used"]["tokens"] == 600 + 50 + 300
            assert state["used"]["cost_usd"] == pytest.approx(0.95)
        finally:
            await worker.close()
            await supervisor.close()

    asyncio.run(body())

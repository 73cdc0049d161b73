"""Session affinity shared by every gateway process through Redis: the deployment a
session (`prompt_cache_key`, `x-session-id`, or `user`) was sent to, for an alias with
several deployments, so its later requests go there whichever process (worker) serves
them (decide/balance.py keeps each process's own map; a task's deployment is already in
the task store, a stored response's in the store).

    {prefix}aff:{alias}:{hash of tenant and session}   the deployment's name, expiring
                                                       TTL_S after the last change

One GET before a session's request is balanced, one SET when it is sent elsewhere than
remembered. Redis being unreachable never fails a request: the process's own map then
decides alone.
"""

from __future__ import annotations

import hashlib
import logging

from redis.exceptions import RedisError

from switchyard.state.redis import count_failure, redis_client

log = logging.getLogger("switchyard")

TTL_S = 3600
_NAME_MAX = 256  # a deployment's name is configured; longer is not ours


class SessionAffinity:
    def __init__(self, url: str, timeout_s: float, prefix: str = "switchyard:") -> None:
        self._redis = redis_client(url, timeout_s)
        self.prefix = prefix
        self.errors = 0

    def _key(self, alias: str, tenant: str | None, session: str) -> str:
        digest = hashlib.sha256(f"{tenant or ''}\x00{session}".encode(errors="replace"))
        return f"{self.prefix}aff:{alias}:{digest.hexdigest()[:40]}"

    async def get(self, alias: str, tenant: str | None, session: str) -> str | None:
        """The deployment the session was last sent to, by any process; None if none
        (or Redis cannot say)."""
        try:
            raw = await self._redis.get(self._key(alias, tenant, session))
        except (RedisError, OSError) as exc:
            self._failed(exc)
            return None
        if raw is None:
            return None
        name = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        return name if len(name) <= _NAME_MAX else None

    async def put(self, alias: str, tenant: str | None, session: str, deployment: str) -> None:
        try:
            await self._redis.set(self._key(alias, tenant, session), deployment, ex=TTL_S)
        except (RedisError, OSError) as exc:
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self.errors = count_failure(log, self.errors, "shared session affinity", exc)

    async def close(self) -> None:
        await self._redis.aclose()

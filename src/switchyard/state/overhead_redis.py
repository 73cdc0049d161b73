"""The learned prompt overhead (policy/cost.py `PromptOverhead`) shared by every gateway
process through Redis, so a budget's reservations lean high in each process as soon as
one of them has seen a model's real prompt counts.

A process's learned (floor, ratio) per model only ever grows, so sharing it is a
max-merge: `exchange` writes this process's values into `{prefix}overhead` (a hash, one
field per model, "floor,ratio"), keeping the larger of each part in one Lua script, and
returns every model's merged values for the caller to take. The control plane runs it
every EXCHANGE_S (control/lifecycle.py). An unreachable Redis changes nothing: each
process keeps learning from its own replies.
"""

from __future__ import annotations

import logging

from redis.exceptions import RedisError

from switchyard.state.redis import count_failure, redis_client

log = logging.getLogger("switchyard")

EXCHANGE_S = 1.0

# KEYS: the hash. ARGV: model, floor, ratio, model, floor, ratio, ... Returns the hash.
_MERGE = """
for i = 1, #ARGV, 3 do
  local floor, ratio = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local old = redis.call('HGET', KEYS[1], ARGV[i])
  if old then
    local f, r = string.match(old, '^([^,]+),([^,]+)$')
    floor = math.max(floor, tonumber(f) or 0)
    ratio = math.max(ratio, tonumber(r) or 0)
  end
  redis.call('HSET', KEYS[1], ARGV[i], string.format('%d,%.17g', floor, ratio))
end
return redis.call('HGETALL', KEYS[1])
"""
_MAX_MODELS = 4096  # a model alias is configured; this only bounds what is read back


class SharedOverhead:
    def __init__(self, url: str, timeout_s: float, prefix: str = "switchyard:") -> None:
        self._redis = redis_client(url, timeout_s)
        self._merge = self._redis.register_script(_MERGE)
        self.key = f"{prefix}overhead"
        self.errors = 0

    async def exchange(self, learned: dict[str, tuple[int, float]]) -> dict[str, tuple[int, float]]:
        """Merge `learned` into the shared values; every model's merged values (empty
        when Redis cannot say)."""
        args: list[str | int | float] = []
        for alias, (floor, ratio) in learned.items():
            args += [alias, int(floor), float(ratio)]
        try:
            if args:
                flat = await self._merge(keys=[self.key], args=args)
            else:
                raw = await self._redis.hgetall(self.key)
                flat = [x for kv in raw.items() for x in kv]
        except (RedisError, OSError) as exc:
            self.errors = count_failure(log, self.errors, "sharing the prompt overhead", exc)
            return {}
        out: dict[str, tuple[int, float]] = {}
        for i in range(0, min(len(flat), 2 * _MAX_MODELS), 2):
            name, value = flat[i], flat[i + 1]
            name = name.decode() if isinstance(name, bytes) else str(name)
            text = value.decode() if isinstance(value, bytes) else str(value)
            try:
                f, r = text.split(",")
                out[name] = (int(f), float(r))
            except ValueError:
                continue
        return out

    async def close(self) -> None:
        await self._redis.aclose()

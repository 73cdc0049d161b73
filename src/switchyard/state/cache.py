"""Response-cache entries: the entry and its keys, and what the cache's implementations
offer each other.

The memory implementation is the response cache itself (decide/cache.py's
`ResponseCache`: each process's own index, searched on the request path). The Redis
implementation shares the entries with every other gateway process
(state/cache_redis.py's `SharedCache`); state/choose.py picks it when `cache.shared`
and `storage.redis_url` are set. There is no SQL one: cached replies live only as long
as a process or Redis keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True, slots=True)
class CacheKeys:
    partition: str  # hash of everything that bounds validity, incl. earlier turns
    exact: str  # hash of the partition + the last user message
    query: str  # the (masked) last user message: what is embedded and verified
    tags: tuple[str, ...]
    tenant: str
    model: str  # the alias asked for (a routed alias: `auto`)
    revision: str = ""  # the revision the partition keys: a reply of another is not stored
    # What answered, set when the reply is stored: the model (a routed alias's routed
    # model; an invalidation by model matches it too) and the revision its reply's
    # `x-switchyard-revision` named (an adapter's: its base's), which a hit repeats.
    answered_model: str = ""
    answered_revision: str = ""


@dataclass(slots=True)
class Entry:
    keys: CacheKeys
    body: bytes  # the stored chat.completion / text_completion JSON
    created: float
    expires: float
    size: int
    row: int = -1  # row in the partition's matrix; -1 when it has no vector
    hits: int = 0


def matches(keys: CacheKeys, f: dict[str, Any]) -> bool:
    """Whether an entry's keys match every filter of an invalidation that is set: a
    model filter matches the alias asked for or the model that answered, a partition
    filter the partition key or its start (decisions show its first 12 characters)."""
    model, partition = f.get("model"), f.get("partition")
    return (
        (f.get("tenant") is None or keys.tenant == f["tenant"])
        and (model is None or model in (keys.model, keys.answered_model))
        and (f.get("tag") is None or f["tag"] in keys.tags)
        and (partition is None or (partition != "" and keys.partition.startswith(partition)))
    )


class LocalEntries(Protocol):
    """What the shared cache reads and changes in the process's own index
    (ResponseCache) as other processes store and invalidate."""

    def entry(self, exact: str) -> Entry | None: ...

    def entries(self) -> list[Entry]: ...

    def drop(self, entry: Entry) -> None: ...

    def store(
        self,
        keys: CacheKeys,
        body: bytes,
        vec: np.ndarray | None,
        ttl_s: float,
        now: float | None = None,
    ) -> Entry: ...

    def invalidate(
        self,
        tenant: str | None = None,
        model: str | None = None,
        tag: str | None = None,
        partition: str | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]: ...

    def adopt_threshold(self, partition: str, raise_by: float) -> None: ...


class CacheShare(Protocol):
    """The entries shared between gateway processes (SharedCache): a store is
    published, an invalidation reaches every process, and a process that reconnects
    catches up."""

    async def put(self, entry: Entry, vec: np.ndarray | None) -> bool: ...

    async def threshold_moved(self, partition: str, raise_by: float) -> None: ...

    async def invalidate(self, f: dict[str, Any], dry_run: bool) -> dict[str, Any]: ...

    async def listen(self) -> None: ...

    async def resync(self) -> int: ...

    async def close(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...

"""Random bytes from the OS's CSPRNG, read a block at a time.

Request ids, response and item ids and the nonces of sealed stored responses each
need a few random bytes per request; on this kind of machine each `getrandom` call
costs ~15 us on the request path (three per request were measurable), so a pool reads
4 KiB at once and hands out slices, each slice once. A child process made by `fork`
starts with empty pools, so parent and child never hand out the same bytes (an AES-GCM
nonce used twice under one key would give the key's authentication away). At the
bottom of the layering: it imports nothing of Switchyard.
"""

from __future__ import annotations

import os
import secrets
import threading
import weakref

_POOLS: weakref.WeakSet[RandomPool] = weakref.WeakSet()


class RandomPool:
    """`take(n)`: n bytes from the OS's CSPRNG that no other caller in any process
    gets. Thread-safe (the store's I/O thread and the event loop both seal)."""

    def __init__(self, block: int = 4096) -> None:
        self._block = block
        self._pool = b""
        self._at = 0
        self._lock = threading.Lock()
        _POOLS.add(self)

    def take(self, n: int) -> bytes:
        with self._lock:
            at = self._at
            if at + n > len(self._pool):
                self._pool, at = secrets.token_bytes(max(self._block, n)), 0
            self._at = at + n
            return self._pool[at : at + n]

    def _forget(self) -> None:
        self._pool, self._at = b"", 0
        self._lock = threading.Lock()  # a lock held in the parent at fork stays held


def _after_fork() -> None:
    for pool in list(_POOLS):
        pool._forget()


os.register_at_fork(after_in_child=_after_fork)

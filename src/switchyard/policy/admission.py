"""Admission control per deployment: a concurrency cap with a bounded wait queue.

A deep queue looks like success until deadlines pass, so the queue is bounded: when
it is full a request is refused at once (429 + Retry-After) instead of waiting
forever, and a request whose deadline passes while queued is answered 504 and never
sent upstream. Waiters are served first in, first out.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from dataclasses import dataclass

from switchyard.errors import DeadlineExceeded, RateLimited


@dataclass(slots=True)
class Admission:
    waited_s: float
    in_flight: int
    queued: int


class DeploymentGate:
    def __init__(self, name: str, max_concurrency: int | None, queue: int) -> None:
        self.name = name
        self.max_concurrency = max_concurrency
        self.queue_size = queue
        self.in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def try_acquire(self) -> Admission | None:
        """Take a free slot without waiting; None when the caller would have to queue."""
        if self.max_concurrency is None or (
            self.in_flight < self.max_concurrency and not self._waiters
        ):
            self.in_flight += 1
            return Admission(0.0, self.in_flight, len(self._waiters))
        return None

    async def acquire(self, deadline: float) -> Admission:
        """Take a slot, waiting in the queue until `deadline` (perf_counter seconds)."""
        start = time.perf_counter()
        free = self.try_acquire()
        if free is not None:
            return free
        if len(self._waiters) >= self.queue_size:
            raise RateLimited(
                f"model '{self.name}' is at capacity ({self.in_flight} running, "
                f"{len(self._waiters)} queued); retry shortly",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(fut, max(0.0, deadline - time.perf_counter()))
        except TimeoutError:
            raise DeadlineExceeded(
                f"the request deadline passed after {time.perf_counter() - start:.2f}s "
                f"in the queue for '{self.name}'; it was not sent upstream"
            ) from None
        except asyncio.CancelledError:
            # Cancelled after being handed a slot: give it to the next waiter.
            if fut.done() and not fut.cancelled():
                self.release()
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(fut)
        return Admission(time.perf_counter() - start, self.in_flight, len(self._waiters))

    def release(self) -> None:
        # Hand the slot straight to the oldest live waiter (in_flight stays the same).
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.in_flight = max(0, self.in_flight - 1)

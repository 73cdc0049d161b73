"""Start and stop: engines and tool servers, the background loops of the other
concerns (retention, busy time, weights, revisions, task cancels from other
processes, the shared cache's events, key changes from other processes, the leases of
background responses), the router and the candidate encoder's build; all given back in
`stop`, which first cuts the background responses running here (failed with the restart
reason, before the upstream clients close)."""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3

from switchyard.control.busy import BusyTime
from switchyard.control.readiness import Readiness
from switchyard.control.retention import Retention
from switchyard.control.revisions import RevisionRecords
from switchyard.control.router import build_router
from switchyard.control.weights import Weights
from switchyard.decide import encoder_build

log = logging.getLogger("switchyard")

# The background tasks `start` makes, cancelled by `stop`.
_LOOPS = (
    "_retention",
    "_weights_task",
    "_cancels",
    "_busy_task",
    "_cache_events",
    "_encoder_task",
    "_control_task",
    "_overhead_task",
    "_key_changes",
    "_leases",
)


class Lifecycle(Readiness, Retention, BusyTime, Weights, RevisionRecords):
    def start(self) -> None:
        """Start engines and models in the background; /readyz reports progress."""
        if self.settings.auth.mode == "disabled":
            log.warning(
                "AUTH IS DISABLED (auth.mode: disabled): anyone who can reach this port may "
                "call every model without limits. Use this for local experiments only."
            )
        elif (
            self.settings.auth.bootstrap_dev_key
            and not self.role.worker  # of several, the control plane makes it, once
            and self.keys.count_tenants() == 0
        ):
            self.keys.create_tenant("dev")
            self.dev_key = self.keys.create_key("dev", name="first-run development key")["key"]
        self.registry.start()
        if self.role.worker:  # what the control plane reports of what runs there
            self._control_task = asyncio.create_task(self._follow_control())
        if self.mcp is not None:
            self.mcp.servers.start()
        try:  # what stopped gateways had in flight: failed, saying why
            self.responses.fail_orphans()
        except sqlite3.Error as exc:  # the database is down: they stay as they were
            log.error("could not mark the responses in flight at the last stop: %s", exc)
        self._leases = asyncio.create_task(self._lease_loop())
        if self.revisions:
            self._revisions_task = asyncio.create_task(self._boot_revisions())
        listen = getattr(self.tasks, "listen", None)
        if listen is not None:  # cancels made through other gateway processes
            self._cancels = asyncio.create_task(listen(self.stop_task))
        if self.cache is not None and self.cache.share is not None:
            self._cache_events = asyncio.create_task(self.cache.share.listen())
        if self.auth.changes is not None:  # key changes made through other processes
            self._key_changes = asyncio.create_task(self.auth.changes.listen(self.auth.invalidate))
        if self.embedder is not None:
            self.embedder.start()
        if not self.role.worker:  # of several, the control plane's alone
            self._retention = asyncio.create_task(self._retention_loop())
        if self.overhead_share is not None:  # what every process learned of prompts
            self._overhead_task = asyncio.create_task(self._share_overhead())
        self._busy_task = asyncio.create_task(self._busy_loop())
        if self.balancers:
            self.refresh_weights()
            self._weights_task = asyncio.create_task(self._weights_loop())
        if self.settings.router.enabled:
            self._router_task = asyncio.create_task(self._build_router())
        self._encoder_task = encoder_build.start(
            self.candidates,
            self.settings.cache,
            self.settings.embeddings,
            lambda: self.readiness()[0],
            self._describe_checks,
            os.cpu_count() or 1,
            follow=self.role.worker,  # of several, the control plane builds it once
        )

    async def _share_overhead(self) -> None:
        """Every EXCHANGE_S: give the learned prompt overhead, take the others'."""
        from switchyard.state.overhead_redis import EXCHANGE_S

        assert self.overhead_share is not None
        known = {m.alias for m in self.settings.models} | {a.name for a in self.settings.adapters}
        while True:
            await asyncio.sleep(EXCHANGE_S)
            merged = await self.overhead_share.exchange(dict(self.overhead.learned))
            for alias, (floor, ratio) in merged.items():
                if alias in known:  # another config's models are not this one's
                    self.overhead.merge(alias, floor, ratio)

    async def _lease_loop(self) -> None:
        """Every third of `responses.lease_s`: renew the leases of the background
        responses this process runs (one write for all); every `lease_s`: fail other
        gateways' whose lease lapsed (their gateway crashed or hung). A database that
        fails is logged and tried again next time."""
        every = self.settings.responses.lease_s / 3
        ticks = 0
        while True:
            await asyncio.sleep(every)
            ticks += 1
            try:
                await self.responses.renew()
                if ticks % 3 == 0:
                    await self.responses.sweep()
            except Exception as exc:
                log.warning("could not renew or check the background responses' leases: %s", exc)

    def _describe_checks(self, text: str) -> None:
        if self.cache is not None:
            self.cache.checks = text

    async def _build_router(self) -> None:
        """Embed the route examples once the embedding model is loaded."""
        self.router = await build_router(self.settings, self.embedder)

    async def stop(self) -> None:
        try:  # before anything they use closes: ended here, not blamed on an upstream
            await self.responses.abandon()
        except Exception as exc:
            log.error("could not mark the background responses cut by this stop: %s", exc)
        for name in _LOOPS:
            task = getattr(self, name, None)
            if task is not None:
                task.cancel()
        build = getattr(self, "_encoder_task", None)
        if build is not None:  # it kills its child process when cancelled
            await asyncio.gather(build, return_exceptions=True)
        try:
            self.flush_busy()
        except Exception as exc:
            log.warning("could not record engine busy time: %s", exc)
        await self.registry.stop()
        if self.mcp is not None:
            await self.mcp.servers.stop()
        boot = getattr(self, "_revisions_task", None)
        if boot is not None:
            boot.cancel()
        await asyncio.gather(*(m.stop() for m in self.revisions.values()), return_exceptions=True)
        if self.embedder is not None:
            await self.embedder.stop()
        close = getattr(self.limiter, "close", None)
        if close is not None:
            await close()
        if self.executor.shared is not None:
            await self.executor.shared.close()
        for gate in {id(g): g for g in self.gates.values()}.values():
            close = getattr(gate, "close", None)  # a worker's remote gates
            if close is not None:
                await close()
        if self.cache is not None and self.cache.share is not None:
            await self.cache.share.close()
        await self.tasks.close()
        if self.overhead_share is not None:
            await self.overhead_share.close()
        if self.auth.changes is not None:
            await self.auth.changes.close()
        if self.sessions is not None:
            await self.sessions.close()
        if self.guard_share is not None:
            await self.guard_share.close()
        await self.responses.drain()  # stored responses written behind their replies
        self.store.close()
        if self.media is not None:
            self.media.close()
        if self.tracing is not None:
            self.tracing.shutdown()

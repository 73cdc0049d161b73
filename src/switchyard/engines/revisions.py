"""Revisions of an RL-managed local model, and the barrier that activates them.

In RL the serving output is training data, so which weights made each sample must be
known exactly. A revision is the model's configured GGUF (kind `base`), another GGUF
file (`gguf`) or a LoRA adapter over the base (`adapter`, the policy delta). New
weights load only from under `rl.weights_dirs`, with a required sha256.

States: prepared (registered, checksum verified) → loaded (its own llama-server is up)
→ validated (the configured validation prompts pass) → active; the active one moves
to draining when another is activated and to retired once its admitted rollouts have
finished (its engine is stopped). A load or validation failure is rejected, with the
reason, and never becomes active. Every change is appended to the revision's history
and persisted (observe/rollouts.py), so revisions survive restarts.

The barrier: a rollout takes a lease on the active revision when it is admitted and
generates every sample on that revision's engine. Activation swaps the active
revision in one step of the event loop, so a rollout admitted before it finishes on
the old revision and every one admitted after it uses the new one; nothing straddles.
Each revision runs its own engine process, so the old one drains while the new one
serves (memory for two, for as long as the drain takes).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import logging
import math
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import aiohttp

from switchyard.config import LlamaCppEngine, ModelConfig, RlConfig, RlModel, VllmEngine
from switchyard.engines import rollout
from switchyard.engines.assets import smollm2_gguf_path
from switchyard.engines.llamacpp import AdapterFile, ManagedLlamaCpp
from switchyard.engines.registry import Deployment
from switchyard.engines.upstream import OpenAIUpstream
from switchyard.engines.vllm import ManagedVllm
from switchyard.errors import (
    ChecksumMismatch,
    InvalidRequest,
    NoActiveRevision,
    PathNotAllowed,
    RevisionConflict,
    RevisionNotFound,
    WeightsLoadingDisabled,
)

log = logging.getLogger("switchyard")

REVISION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
RESERVED = {"rollback"}  # a path word of the admin API
ADAPTER_FILE = "adapter_model.safetensors"  # a PEFT folder's weights (vLLM revisions)


class RevState(enum.StrEnum):
    PREPARED = "prepared"
    LOADED = "loaded"
    VALIDATED = "validated"
    ACTIVE = "active"
    DRAINING = "draining"
    RETIRED = "retired"
    REJECTED = "rejected"


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(eq=False)
class Revision:
    alias: str
    revision: str
    kind: str  # base | gguf | adapter
    path: str
    sha256: str
    state: str
    reason: str = ""
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    history: list[dict[str, Any]] = field(default_factory=list)
    engine: ManagedLlamaCpp | None = None
    in_flight: int = 0
    facts: dict[str, Any] | None = None  # the engine's and tokenizer's provenance
    validation: list[dict[str, Any]] | None = None
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    moving: asyncio.Task[None] | None = None  # the lifecycle step running for it

    def row(self) -> dict[str, Any]:
        return {
            "alias": self.alias,
            "revision": self.revision,
            "kind": self.kind,
            "path": self.path,
            "sha256": self.sha256,
            "state": self.state,
            "reason": self.reason,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "history": self.history,
        }

    def describe(self) -> dict[str, Any]:
        out = self.row()
        out["path"] = os.path.basename(self.path)  # where on disk stays with the operator
        out["in_flight"] = self.in_flight
        out["validation"] = self.validation
        out["engine"] = self.facts.get("engine") if self.facts else None
        return out

    @property
    def served_as(self) -> str | None:
        """The model name vLLM serves this revision's adapter under (None: the base)."""
        return self.revision if self.kind == "adapter" else None

    @property
    def lora(self) -> list[dict[str, Any]] | None:
        """The `lora` list of this revision's requests (its adapter at scale 1)."""
        if self.kind != "adapter" or self.engine is None:
            return None
        return self.engine.lora_scales(self.revision)


@dataclass(eq=False)
class Lease:
    """A rollout's hold on the revision it was admitted under."""

    rev: Revision
    manager: RevisionManager
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.manager._release(self.rev)


def _engine_url(rev: Revision) -> str:
    engine = rev.engine  # replaced when a retired revision is brought up again
    return engine.base_url if engine is not None else "http://127.0.0.1:0/v1"


class RevisionManager:
    """The revisions of one RL-managed model (rl.models[alias])."""

    def __init__(
        self,
        model: ModelConfig,
        rl: RlModel,
        settings: RlConfig,
        max_crash_restarts: int,
        persist: Callable[[dict[str, Any]], Awaitable[None]],
        on_change: Callable[[Revision, str], None] | None = None,
    ) -> None:
        """`persist` stores a revision's row; `on_change` hears each state a revision
        enters (the metrics' revision_event)."""
        assert isinstance(model.engine, LlamaCppEngine | VllmEngine)
        self.model = model
        self.alias = model.alias
        # vLLM: the base is a model folder and new revisions are PEFT adapter folders
        # (a revision's sha256 is that of its safetensors file); llama.cpp: GGUF files.
        self.vllm = isinstance(model.engine, VllmEngine)
        self.spec = model.engine.model_copy(update={"lazy": False, "pinned": True})
        self.rl = rl
        self.settings = settings
        self.crash = max_crash_restarts
        self._persist = persist
        self.revisions: dict[str, Revision] = {}
        self.active: Revision | None = None
        self.activations: list[str] = []  # the revisions activated, in order (rollback)
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()  # one activation or rollback at a time
        self.on_change = on_change  # metrics
        # Chat and completions on the alias go to the active revision's engine: a
        # client per revision, a deployment per (revision, engine process).
        self._upstreams: dict[str, OpenAIUpstream] = {}
        self._deployments: dict[str, Deployment] = {}

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)
            )
        return self._session

    # -- boot and stop ----------------------------------------------------------------
    async def boot(self, stored: list[dict[str, Any]]) -> None:
        """Restore the stored revisions; bring up the one that was active (or the base)."""
        for row in stored:
            rev = Revision(
                row["alias"],
                row["revision"],
                row["kind"],
                row["path"],
                row["sha256"],
                row["state"],
                row["reason"],
                row["created_at"],
                row["updated_at"],
                list(row["history"]),
            )
            self.revisions[rev.revision] = rev
        base_id = self.model.revision
        if base_id not in self.revisions:
            path, weights = self._base_weights()
            digest = await asyncio.to_thread(sha256_of, weights)
            rev = Revision(self.alias, base_id, "base", path, digest, RevState.PREPARED)
            self.revisions[base_id] = rev
            await self._move(rev, RevState.PREPARED, "the model's configured weights")
        was_active = [r for r in self.revisions.values() if r.state == RevState.ACTIVE]
        for r in self.revisions.values():
            if r.state in (RevState.LOADED, RevState.VALIDATED, RevState.DRAINING) or (
                r.state == RevState.ACTIVE and r is not was_active[-1]
            ):
                await self._move(r, RevState.RETIRED, "the gateway restarted")
        target = was_active[-1] if was_active else self.revisions[base_id]
        if target.state == RevState.ACTIVE:
            target.state = RevState.VALIDATED  # re-earned below: loaded and validated again
        await self._bring_up(target)
        if target.state == RevState.VALIDATED:
            await self._switch(
                target, "restored at start" if was_active else "the initial revision"
            )

    async def stop(self) -> None:
        for r in self.revisions.values():
            if r.moving is not None:
                r.moving.cancel()
        engines = [r.engine for r in self.revisions.values() if r.engine is not None]
        await asyncio.gather(*(e.stop() for e in engines), return_exceptions=True)
        await asyncio.gather(*(u.close() for u in self._upstreams.values()), return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    # -- the data plane: leases -------------------------------------------------------
    def lease(self) -> Lease:
        """A hold on the active revision (the barrier's side of a rollout)."""
        rev = self.active
        if rev is None or rev.engine is None or not rev.engine.ready:
            raise NoActiveRevision(
                f"the model '{self.alias}' has no active revision ready to serve",
                headers={"Retry-After": "2"},
            )
        rev.in_flight += 1
        rev.drained.clear()
        return Lease(rev, self)

    def deployment(self, rev: Revision) -> Deployment:
        """Where a chat or completion request holding a lease on `rev` is sent: its
        engine, with its adapter applied for an adapter revision, and the model's
        config naming `rev` as the revision (usage rows, traces and cache keys)."""
        engine = rev.engine
        assert engine is not None  # a lease is only given on a ready engine
        dep = self._deployments.get(rev.revision)
        if dep is not None and dep.engine is engine:
            return dep
        upstream = self._upstreams.get(rev.revision)
        if upstream is None:
            upstream = OpenAIUpstream(
                f"{engine.kind}:{engine.alias}", partial(_engine_url, rev), max_connections=64
            )
            self._upstreams[rev.revision] = upstream
        dep = Deployment(self.model.model_copy(update={"revision": rev.revision}), upstream, engine)
        if rev.kind == "adapter" and self.vllm:
            dep.upstream_model = rev.revision  # vLLM serves the adapter by its name
        elif rev.kind == "adapter":
            dep.lora = partial(engine.lora_scales, rev.revision)
        self._deployments[rev.revision] = dep
        return dep

    def _release(self, rev: Revision) -> None:
        rev.in_flight -= 1
        if rev.in_flight <= 0:
            rev.in_flight = 0
            rev.drained.set()

    # -- the control plane ------------------------------------------------------------
    def check_path(self, path: Any) -> str:
        """The real path of a file under rl.weights_dirs, or a refusal."""
        if not self.settings.weights_dirs:
            raise WeightsLoadingDisabled(
                "loading weights at run time is off: rl.weights_dirs is empty"
            )
        if not isinstance(path, str) or not path or len(path) > 4096 or "\0" in path:
            raise InvalidRequest("'path' must be a file path", param="path")
        real = os.path.realpath(path)
        for d in self.settings.weights_dirs:
            root = os.path.realpath(os.path.expanduser(d))
            if os.path.commonpath([root, real]) == root and real != root:
                break
        else:
            raise PathNotAllowed("the file is not under any of rl.weights_dirs", param="path")
        if self.vllm:  # a PEFT adapter folder
            if not os.path.isfile(os.path.join(real, ADAPTER_FILE)):
                raise InvalidRequest(
                    f"no PEFT adapter folder (with {ADAPTER_FILE}) there under rl.weights_dirs",
                    param="path",
                )
            weights = os.path.join(real, ADAPTER_FILE)
        elif not os.path.isfile(real):
            raise InvalidRequest("no such file under rl.weights_dirs", param="path")
        else:
            weights = real
        if os.path.getsize(weights) > self.settings.max_weights_mb * 1024 * 1024:
            raise InvalidRequest("the file is larger than rl.max_weights_mb", param="path")
        return real

    def _base_weights(self) -> tuple[str, str]:
        """(the configured weights' path, the file its sha256 is of)."""
        if isinstance(self.spec, VllmEngine):
            from switchyard.engines.hf_base import hf_base_dir

            folder = str(hf_base_dir()) if self.spec.model == "auto" else self.spec.model
            return folder, os.path.join(folder, "model.safetensors")
        assert isinstance(self.spec, LlamaCppEngine)
        path = smollm2_gguf_path() if self.spec.gguf == "auto" else self.spec.gguf
        return path, path

    async def register(self, body: dict[str, Any]) -> Revision:
        """A new revision, prepared once its file passed its checksum; its load and
        validation (and activation, if asked) run in the background."""
        rev_id = body.get("revision")
        if not isinstance(rev_id, str) or not REVISION_ID.fullmatch(rev_id) or rev_id in RESERVED:
            raise InvalidRequest(
                "'revision' must be 1-64 letters, digits, '.', '_' or '-' (not 'rollback')",
                param="revision",
            )
        kind = body.get("kind", "gguf")
        if kind not in ("gguf", "adapter"):
            raise InvalidRequest("'kind' must be 'gguf' or 'adapter'", param="kind")
        if self.vllm and kind != "adapter":
            raise InvalidRequest(
                "a vllm model's revisions are PEFT adapters: 'kind' must be 'adapter'",
                param="kind",
            )
        digest = body.get("sha256")
        if not isinstance(digest, str) or not SHA256.match(digest):
            raise InvalidRequest("'sha256' (64 lowercase hex digits) is required", param="sha256")
        activate = body.get("activate", False)
        if not isinstance(activate, bool):
            raise InvalidRequest("'activate' must be a boolean", param="activate")
        if rev_id in self.revisions:
            raise RevisionConflict(
                f"the revision '{rev_id}' is already registered", param="revision"
            )
        real = self.check_path(body.get("path"))
        weights = os.path.join(real, ADAPTER_FILE) if self.vllm else real
        actual = await asyncio.to_thread(sha256_of, weights)
        if actual != digest:
            raise ChecksumMismatch("the file's sha256 does not match 'sha256'", param="sha256")
        if rev_id in self.revisions:  # registered meanwhile
            raise RevisionConflict(
                f"the revision '{rev_id}' is already registered", param="revision"
            )
        rev = Revision(self.alias, rev_id, kind, real, digest, RevState.PREPARED)
        self.revisions[rev_id] = rev
        await self._move(rev, RevState.PREPARED, "registered; checksum verified")
        rev.moving = asyncio.create_task(self._prepare(rev, activate), name=f"revision:{rev_id}")
        return rev

    def get(self, rev_id: str) -> Revision:
        rev = self.revisions.get(rev_id)
        if rev is None:
            raise RevisionNotFound(f"the model '{self.alias}' has no revision '{rev_id[:64]}'")
        return rev

    async def activate(self, rev_id: str, why: str = "activated by the operator") -> Revision:
        """Activate a revision: one not loaded (retired) is loaded and validated again
        first; a rejected one never is."""
        rev = self.get(rev_id)
        if rev.state == RevState.REJECTED:
            raise RevisionConflict(
                f"the revision '{rev_id}' was rejected ({rev.reason}); it cannot be activated"
            )
        if rev.state == RevState.ACTIVE:
            return rev
        if rev.state == RevState.PREPARED and rev.moving is not None and not rev.moving.done():
            await asyncio.shield(rev.moving)  # its load and validation are under way
        async with self._lock:
            if rev.state in (RevState.RETIRED, RevState.DRAINING, RevState.PREPARED):
                await self._bring_up(rev)
            if rev.state != RevState.VALIDATED:
                raise RevisionConflict(
                    f"the revision '{rev_id}' did not validate ({rev.reason}); not activated"
                )
            await self._switch(rev, why)
        return rev

    async def rollback(self) -> Revision:
        """Re-activate the revision that was active before the current one."""
        current = self.active.revision if self.active is not None else None
        for rev_id in reversed(self.activations[:-1]):
            if rev_id != current and self.revisions[rev_id].state != RevState.REJECTED:
                return await self.activate(rev_id, f"rollback from {current}")
        raise RevisionConflict(f"the model '{self.alias}' has no earlier revision to roll back to")

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.alias,
            "active": self.active.revision if self.active is not None else None,
            "revisions": [r.describe() for r in self.revisions.values()],
        }

    # -- lifecycle steps ----------------------------------------------------------------
    async def _prepare(self, rev: Revision, activate: bool) -> None:
        try:
            await self._bring_up(rev)
            if activate and rev.state == RevState.VALIDATED:
                async with self._lock:
                    await self._switch(rev, "activated on registration")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave a revision half-moved silently
            log.exception("revision %s of %s failed", rev.revision, self.alias)
            await self._reject(rev, f"internal error ({type(exc).__name__})")

    def _engine_for(self, rev: Revision) -> ManagedLlamaCpp:
        name = f"{self.alias}@{rev.revision}"
        if self.vllm:  # the base folder, and the revision's adapter served by its name
            files = (
                (AdapterFile(rev.revision, rev.path, rev.sha256, rev.revision),)
                if rev.kind == "adapter"
                else ()
            )
            return ManagedVllm(name, self.spec, self.crash, adapters=files)
        if rev.kind == "adapter":
            adapter = AdapterFile(rev.revision, rev.path, rev.sha256, rev.revision)
            return ManagedLlamaCpp(name, self.spec, self.crash, adapters=(adapter,))
        spec = self.spec.model_copy(update={"gguf": rev.path})
        return ManagedLlamaCpp(name, spec, self.crash)

    async def _bring_up(self, rev: Revision) -> None:
        """prepared/retired → loaded → validated, or rejected with why."""
        if rev.engine is None or not rev.engine.ready:
            engine = self._engine_for(rev)
            rev.engine = engine
            engine.start()
            ok = await engine.wait_ready(self.spec.startup_timeout_s)
            if not ok:
                why = engine.reason or engine.last_error or "did not become ready in time"
                await self._reject(rev, f"the engine did not load it: {why}")
                return
            if rev.kind == "adapter" and rev.revision not in engine.adapter_ids:
                why = engine.adapter_errors.get(rev.revision, "the engine did not load the adapter")
                await self._reject(rev, why)
                return
            facts = await rollout.facts(self.session, engine)
            digest = rollout.hf_tokenizer_digest if self.vllm else rollout.tokenizer_digest
            digests = await asyncio.to_thread(digest, engine.resolve()[0])
            rev.facts = {"engine": facts, **digests}
            await self._move(rev, RevState.LOADED, f"engine up ({facts.get('version')})")
        results, failure = await self._validate(rev)
        rev.validation = results
        if failure is not None:
            await self._reject(rev, failure)
            return
        await self._move(rev, RevState.VALIDATED, f"{len(results)} validation prompts passed")

    async def _validate(self, rev: Revision) -> tuple[list[dict[str, Any]], str | None]:
        """Greedy answers to the validation prompts, checked: (results, why it failed)."""
        assert rev.engine is not None
        results: list[dict[str, Any]] = []
        for i, v in enumerate(self.rl.validation):
            try:
                ids = await rollout.prompt_ids(self.session, rev.engine, v.prompt, v.messages)
                s = rollout.Sampling(0.0, 1.0, 0, 0.0, v.max_tokens, 0, (), 0)
                out = await rollout.draw(self.session, rev.engine, ids, s, rev.lora, rev.served_as)
            except rollout.EngineCallFailed as exc:
                return results, f"validation prompt {i}: {exc}"
            lps = [x for x in out["logprobs"] if x is not None]
            mean = sum(lps) / len(lps) if lps else 0.0
            low = out["text"].lower()
            result = {
                "prompt": i,
                "output": out["text"][:200],
                "mean_logprob": round(mean, 4),
                "tokens": len(lps),
            }
            results.append(result)
            if not lps or any(not math.isfinite(x) or x > 1e-4 for x in lps):
                return results, f"validation prompt {i}: logprobs missing, not finite or above 0"
            if mean < v.min_mean_logprob:
                return results, (
                    f"validation prompt {i}: mean logprob {mean:.3f} is below {v.min_mean_logprob}"
                )
            if v.expect_any and not any(e.lower() in low for e in v.expect_any):
                return results, f"validation prompt {i}: none of {v.expect_any} in the output"
            hit = next((f for f in v.forbid if f.lower() in low), None)
            if hit is not None:
                return results, f"validation prompt {i}: the output contains {hit!r}"
        return results, None

    async def _switch(self, rev: Revision, why: str) -> None:
        """The barrier: `rev` is active from this step on; the old one drains."""
        old = self.active
        self.active = rev
        self.activations.append(rev.revision)
        await self._move(rev, RevState.ACTIVE, why)
        if old is not None and old is not rev:
            await self._move(old, RevState.DRAINING, f"{rev.revision} activated")
            old.moving = asyncio.create_task(self._retire(old), name=f"drain:{old.revision}")

    async def _retire(self, rev: Revision) -> None:
        if rev.in_flight > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rev.drained.wait(), self.rl.drain_timeout_s)
        if rev.state != RevState.DRAINING:  # re-activated while it drained
            return
        left = rev.in_flight
        engine, rev.engine = rev.engine, None
        if engine is not None:
            await engine.stop()
        why = "drained" if left == 0 else f"drain timeout with {left} rollouts in flight"
        await self._move(rev, RevState.RETIRED, why)

    async def _reject(self, rev: Revision, why: str) -> None:
        engine, rev.engine = rev.engine, None
        if engine is not None:
            await engine.stop()
        await self._move(rev, RevState.REJECTED, why)

    async def _move(self, rev: Revision, state: str, why: str) -> None:
        now = time.time()
        rev.state = RevState(state)
        rev.reason = why
        rev.updated_at = now
        rev.history.append({"state": str(state), "at": round(now, 6), "reason": why})
        log.info("revision %s of %s: %s (%s)", rev.revision, self.alias, state, why)
        if self.on_change is not None:
            self.on_change(rev, str(state))
        try:
            await self._persist(rev.row())
        except Exception as exc:  # the state holds in memory; the store catches up
            log.error("could not persist revision %s of %s: %s", rev.revision, self.alias, exc)

"""`POST /v1/rollouts`: one request's lifecycle, from its body to its stored records.

authenticate → validate (every field bounded) → authorize the model (the key's models
and the tenant's regions, as chat) → lease the active revision (engines/revisions.py:
the barrier) → tokenize the prompts on it → admit (the key's and tenant's rpm, tpm,
concurrency and budget, for every sample's real prompt token count and max_tokens at
once: what is billed is never more than what was reserved) → generate the samples, at
most the engine's slots at a time, until the request's deadline → stream each record
as NDJSON as it finishes → settle (limits, the usage row naming the revision, the
trace) → store the records (PII masked, credential-shaped ids scrubbed,
observe/rollouts.py).

A refusal comes before the first byte, as an OpenAI-shaped error with its status. A
sample the engine fails is a record with finish_reason "error" and a safe message;
the other samples go on. The last line is a summary, or a `rollout.error` line when
the engine failed or the deadline passed (the samples not drawn by then are cancelled).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from switchyard import outcomes
from switchyard.config import Settings, VllmEngine
from switchyard.engines import rollout
from switchyard.engines.revisions import Lease, RevisionManager
from switchyard.errors import (
    DeadlineExceeded,
    EngineNotReady,
    InvalidRequest,
    ModelNotAllowed,
    ModelNotFound,
    RegionNotAllowed,
    UpstreamError,
)
from switchyard.pipeline import RequestContext, Status
from switchyard.policy.admit import principal_scopes
from switchyard.policy.stages import Reserver
from switchyard.policy.validate import validate_chat
from switchyard.request import Generation

log = logging.getLogger("switchyard")

_FIELDS = {
    "model",
    "prompts",
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "seeds",
    "stop",
    "top_logprobs",
    "dataset_revision",
    "deterministic",
}
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-/")
SEED_MAX = 2**31 - 1


@dataclass
class Prompt:
    id: str
    text: str | None  # a text prompt, as given
    messages: list[dict[str, Any]] | None  # a chat prompt, rendered by the engine's template


@dataclass
class Plan:
    """A validated rollout request."""

    alias: str
    prompts: list[Prompt]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seeds: list[int]
    stop: tuple[str, ...]
    top_logprobs: int
    dataset_revision: str | None
    deterministic: bool = False
    lease: Lease | None = None
    prompt_ids: list[list[int]] = field(default_factory=list)  # per prompt, on the lease
    records: list[dict[str, Any]] = field(default_factory=list)
    # The samples at the engine now, (prompt, sample) -> their prompt's token count: one
    # cut there (the deadline, the client gone) is billed as if it wrote max_tokens.
    drawing: dict[tuple[int, int], int] = field(default_factory=dict)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise InvalidRequest(f"'{name}' must be a number from {lo:g} to {hi:g}", param=name)
    return float(v)


def _integer(body: dict[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    v = body.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InvalidRequest(f"'{name}' must be an integer from {lo} to {hi}", param=name)
    return v


def _ident(v: Any, param: str) -> str:
    if not isinstance(v, str) or not 1 <= len(v) <= 128 or not _ID_CHARS.issuperset(v):
        raise InvalidRequest(f"'{param}' must be 1-128 letters, digits or . _ : - /", param=param)
    return v


def validate_rollout(body: Any, settings: Settings) -> Plan:
    """The request's plan, or a 400 naming the first bad field."""
    rl = settings.rl
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown field '{unknown[0][:64]}'", param=unknown[0][:64])
    alias = body.get("model")
    if not isinstance(alias, str) or not 1 <= len(alias) <= 128:
        raise InvalidRequest("'model' is required", param="model")
    raw = body.get("prompts")
    if not isinstance(raw, list) or not 1 <= len(raw) <= rl.max_prompts:
        raise InvalidRequest(
            f"'prompts' must be a list of 1 to {rl.max_prompts} prompts", param="prompts"
        )
    prompts: list[Prompt] = []
    for i, p in enumerate(raw):
        where = f"prompts[{i}]"
        if isinstance(p, str):
            p = {"prompt": p}
        if not isinstance(p, dict) or set(p) - {"id", "prompt", "messages"}:
            raise InvalidRequest(
                f"'{where}' must be a string or an object with 'prompt' or 'messages' "
                "(and an optional 'id')",
                param=where,
            )
        pid = _ident(p["id"], f"{where}.id") if "id" in p else str(i)
        if ("prompt" in p) == ("messages" in p):
            raise InvalidRequest(
                f"'{where}' needs exactly one of 'prompt' and 'messages'", param=where
            )
        if "prompt" in p:
            text = p["prompt"]
            if not isinstance(text, str) or not 1 <= len(text) <= rl.max_prompt_chars:
                raise InvalidRequest(
                    f"'{where}.prompt' must be a string of 1 to {rl.max_prompt_chars} characters",
                    param=f"{where}.prompt",
                )
            prompts.append(Prompt(pid, text, None))
            continue
        msgs = p["messages"]
        try:
            validate_chat({"model": alias, "messages": msgs}, "reject")
        except InvalidRequest as exc:
            raise InvalidRequest(f"{where}: {exc.message}", param=f"{where}.messages") from None
        chars = sum(len(m.get("content") or "") for m in msgs if isinstance(m.get("content"), str))
        if chars > rl.max_prompt_chars or any(not isinstance(m.get("content"), str) for m in msgs):
            raise InvalidRequest(
                f"'{where}.messages' must hold text contents of at most {rl.max_prompt_chars} "
                "characters in all",
                param=f"{where}.messages",
            )
        prompts.append(
            Prompt(pid, None, [{"role": m["role"], "content": m["content"]} for m in msgs])
        )
    if len({p.id for p in prompts}) != len(prompts):
        raise InvalidRequest("prompt ids must be unique", param="prompts")
    n = _integer(body, "n", 1, 1, rl.max_n)
    if n * len(prompts) > rl.max_samples:
        raise InvalidRequest(
            f"{len(prompts)} prompts x n {n} is more than rl.max_samples ({rl.max_samples})",
            param="n",
        )
    default_max = min(settings.policy.default_max_tokens, rl.max_tokens)
    max_tokens = _integer(body, "max_tokens", default_max, 1, rl.max_tokens)
    if "seeds" in body:
        seeds = body["seeds"]
        if "seed" in body:
            raise InvalidRequest("give 'seed' or 'seeds', not both", param="seeds")
        if (
            not isinstance(seeds, list)
            or len(seeds) != n
            or any(
                isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= SEED_MAX
                for s in seeds
            )
        ):
            raise InvalidRequest(
                f"'seeds' must be a list of n ({n}) integers from 0 to {SEED_MAX}", param="seeds"
            )
    else:
        base = _integer(body, "seed", random.randrange(SEED_MAX - 4096), 0, SEED_MAX - 4096)
        seeds = [base + j for j in range(n)]
    stop = body.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if (
        not isinstance(stop, list)
        or len(stop) > 4
        or any(not isinstance(s, str) or not 1 <= len(s) <= 64 for s in stop)
    ):
        raise InvalidRequest(
            "'stop' must be a string or up to 4 strings of 1-64 characters", param="stop"
        )
    dataset = body.get("dataset_revision")
    deterministic = body.get("deterministic", False)
    if not isinstance(deterministic, bool):
        raise InvalidRequest("'deterministic' must be a boolean", param="deterministic")
    return Plan(
        alias,
        prompts,
        n,
        max_tokens,
        _number(body, "temperature", 1.0, 0.0, 2.0),
        _number(body, "top_p", 1.0, 0.0, 1.0),
        _integer(body, "top_k", 0, 0, 1000),
        _number(body, "min_p", 0.0, 0.0, 1.0),
        list(seeds),
        tuple(stop),
        _integer(body, "top_logprobs", 0, 0, rl.max_top_logprobs),
        _ident(dataset, "dataset_revision") if dataset is not None else None,
        deterministic,
    )


# What a record's logprobs are, per engine kind.
LOGPROBS = {
    "llamacpp": "llama-server, before sampling transforms (post_sampling_probs off)",
    "vllm": "vLLM raw logprobs, before sampling transforms (its default logprobs mode)",
}


class RolloutService:
    """Runs rollout requests (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        service: Any,  # service.RequestService: open, settle
        reserver: Reserver,
        managers: dict[str, RevisionManager],
        store_records: Callable[[list[dict[str, Any]]], Awaitable[None]] | None,
        mask: Callable[[str], str],
        contains_pii: Callable[[str], bool],
    ) -> None:
        self.settings = settings
        self.service = service
        self.reserver = reserver
        self.managers = managers
        self.store_records = store_records
        self._mask = mask
        self._contains_pii = contains_pii
        self._models = {m.alias: m for m in settings.models}

    async def admit(self, ctx: RequestContext, body: Any) -> Plan:
        """Validate, authorize, admit and lease; raises the refusal (the caller settles)."""
        t = time.perf_counter()
        plan = validate_rollout(body, self.settings)
        ctx.record("validate", outcomes.Validate.OK, "rollout request shape is valid", t)
        manager = self.managers.get(plan.alias)
        model = self._models.get(plan.alias)
        if manager is None or model is None or not ctx.principal.may_use(plan.alias):
            if model is not None and not ctx.principal.may_use(plan.alias):
                raise ModelNotAllowed(
                    f"this key may not use the model '{plan.alias}'", param="model"
                )
            raise ModelNotFound(
                f"the model '{plan.alias[:128]}' does not serve rollouts (rl.models)", param="model"
            )
        ctx.alias = plan.alias
        ctx.model = model
        ctx.request = Generation(model=plan.alias)
        # The tenant's regions, as chat keeps to them (execute/executor.py `_try_at`):
        # the model's data boundary narrowed to the tenant's regions.
        boundary = ctx.principal.boundary(model.data_boundary)
        if boundary is not None and model.region not in boundary:
            why = f"region {model.region!r} is outside the allowed {boundary}"
            raise RegionNotAllowed(f"the model '{plan.alias}' may not serve this tenant: {why}")
        t = time.perf_counter()
        plan.lease = manager.lease()
        try:
            rev = plan.lease.rev
            # The usage row and trace name the revision that serves every sample.
            ctx.model = model.model_copy(update={"revision": rev.revision})
            ctx.record(
                "revision",
                outcomes.tagged(outcomes.Kind.LEASE, rev.revision),
                "the active revision at admission serves every sample (the barrier)",
                t,
                {"revision": rev.revision, "kind": rev.kind, "in_flight": rev.in_flight},
            )
            # The ids each prompt is read and billed as, known before anything is
            # reserved: the reservation is what the samples can cost at most (each
            # sample bills its prompt's ids and at most max_tokens).
            plan.prompt_ids = await self._prompt_ids(ctx, plan, rev)
            prompt = sum(len(ids) for ids in plan.prompt_ids)
            estimate = (
                prompt * plan.n,
                plan.max_tokens * plan.n * len(plan.prompts),
                model.price,
            )
            scopes = principal_scopes(ctx.principal)
            if scopes:
                await self.reserver.reserve(ctx, scopes, "admit", estimate)
        except BaseException:
            plan.lease.release()
            plan.lease = None
            raise
        return plan

    async def stream(self, ctx: RequestContext, plan: Plan) -> AsyncIterator[bytes]:
        """The records as NDJSON lines as they finish, then the summary; settles at the end."""
        lease = plan.lease
        assert lease is not None
        rev = lease.rev
        engine = rev.engine
        ctx.status = Status.STREAMING
        pending: set[asyncio.Task[dict[str, Any]]] = set()
        inp = out = errors = 0
        try:
            assert engine is not None
            prompt_ids = plan.prompt_ids
            parallel = self.settings_parallel(plan.alias)
            slots = asyncio.Semaphore(max(1, parallel))
            ctx.timings.upstream_sent = time.perf_counter()
            for i, p in enumerate(plan.prompts):
                for j in range(plan.n):
                    pending.add(
                        asyncio.create_task(
                            self._one(ctx, plan, rev, p, i, j, prompt_ids[i], slots)
                        )
                    )
            first = True
            while pending:
                # The request's deadline bounds the rollout (x-request-timeout, or
                # server.default_deadline_s): past it, the samples not drawn yet are
                # cancelled (their engine calls with them) and the stream ends.
                left = ctx.remaining_s()
                if left <= 0:
                    raise DeadlineExceeded("the request's deadline passed during the rollout")
                done, pending = await asyncio.wait(
                    pending, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    rec = task.result()
                    if first:
                        ctx.timings.upstream_first_byte = time.perf_counter()
                        first = False
                    u = rec["usage"]
                    inp += u["prompt_tokens"]
                    out += u["completion_tokens"]
                    errors += rec["finish_reason"] == "error"
                    plan.records.append(rec)
                    ctx.run.chunks += u["completion_tokens"]
                    yield orjson.dumps(rec) + b"\n"
            ctx.status = Status.OK
            yield (
                orjson.dumps(
                    {
                        "object": "rollout.summary",
                        "request_id": ctx.input.request_id,
                        "model": plan.alias,
                        "revision": rev.revision,
                        "samples": len(plan.records),
                        "completed": len(plan.records) - errors,
                        "errors": errors,
                        "usage": {"prompt_tokens": inp, "completion_tokens": out},
                    }
                )
                + b"\n"
            )
        except asyncio.CancelledError:
            ctx.status, ctx.error_code = Status.CANCELLED, "client_disconnected"
            raise
        except (rollout.EngineCallFailed, DeadlineExceeded) as exc:
            code = "engine_error" if isinstance(exc, rollout.EngineCallFailed) else exc.code
            ctx.status, ctx.error_code = Status.ERROR, code
            for task in pending:
                task.cancel()
            yield (
                orjson.dumps(
                    {"object": "rollout.error", "error": {"code": code, "message": str(exc)}}
                )
                + b"\n"
            )
        finally:
            for task in pending:
                task.cancel()
            if pending:  # the engine calls end here, not on their own later
                await asyncio.gather(*pending, return_exceptions=True)
            if plan.drawing:  # cut at the engine: each may have written all it was let
                inp += sum(plan.drawing.values())
                out += plan.max_tokens * len(plan.drawing)
            lease.release()
            ctx.run.attempts = 1
            ctx.run.usage = {"prompt_tokens": inp, "completion_tokens": out}
            ctx.timings.ended = time.perf_counter()
            await self.service.settle(ctx)
            if self.store_records is not None and plan.records:
                try:
                    pii = {
                        p.id
                        for p in plan.prompts
                        if self._contains_pii(
                            p.text or "\n".join(m["content"] for m in p.messages or [])
                        )
                    }
                    await self.store_records([self._at_rest(r, pii) for r in plan.records])
                except Exception as exc:  # the client has every record; the log says so
                    log.error("could not store %d rollout records: %s", len(plan.records), exc)

    async def abandon(self, ctx: RequestContext, plan: Plan) -> None:
        """After the response: a stream the client left before it started still lets
        go of its revision and is settled (both are no-ops after a finished stream)."""
        if ctx.status == Status.PENDING:
            ctx.status, ctx.error_code = Status.CANCELLED, "client_disconnected"
        if plan.lease is not None:
            plan.lease.release()
        await self.service.settle(ctx)

    def settings_parallel(self, alias: str) -> int:
        spec = self.managers[alias].spec
        return spec.max_num_seqs if isinstance(spec, VllmEngine) else spec.parallel

    async def _prompt_ids(self, ctx: RequestContext, plan: Plan, rev: Any) -> list[list[int]]:
        """Each prompt's token ids on the serving revision's engine (its template),
        within the request's deadline; a refusal (502, 504) when the engine fails."""
        engine = rev.engine
        if engine is None:
            raise EngineNotReady(f"the model '{plan.alias}' has no engine serving it")
        manager = self.managers[plan.alias]

        async def tokenize() -> list[list[int]]:
            return [
                await rollout.prompt_ids(manager.session, engine, p.text, p.messages)
                for p in plan.prompts
            ]

        left = ctx.remaining_s()
        try:
            if left <= 0:
                raise TimeoutError
            return await asyncio.wait_for(tokenize(), left)
        except TimeoutError:
            raise DeadlineExceeded(
                "the request's deadline passed while its prompts were tokenized"
            ) from None
        except rollout.EngineCallFailed as exc:
            raise UpstreamError(f"the engine could not tokenize the prompts: {exc}") from None

    async def _one(
        self,
        ctx: RequestContext,
        plan: Plan,
        rev: Any,
        p: Prompt,
        i: int,
        j: int,
        ids: list[int],
        slots: asyncio.Semaphore,
    ) -> dict[str, Any]:
        s = rollout.Sampling(
            plan.temperature,
            plan.top_p,
            plan.top_k,
            plan.min_p,
            plan.max_tokens,
            plan.seeds[j],
            plan.stop,
            plan.top_logprobs,
            plan.deterministic,
        )
        manager = self.managers[plan.alias]
        started = time.time()
        async with slots:
            plan.drawing[i, j] = len(ids)  # kept there if it is cancelled mid-draw
            try:
                got = await rollout.draw(
                    manager.session, rev.engine, ids, s, rev.lora, rev.served_as
                )
                error = None
            except rollout.EngineCallFailed as exc:
                got, error = None, {"code": "engine_error", "message": str(exc)}
            del plan.drawing[i, j]
        facts = rev.facts or {}
        record: dict[str, Any] = {
            "object": "rollout.sample",
            "sample_id": f"{ctx.input.request_id}-{i}-{j}",
            "request_id": ctx.input.request_id,
            "prompt_id": p.id,
            "sample_index": j,
            "tenant_id": ctx.principal.tenant_id,
            "prompt_token_ids": ids,
            "text": got["text"] if got else "",
            "token_ids": got["token_ids"] if got else [],
            "logprobs": got["logprobs"] if got else [],
            # Positions whose logprob the engine did not report (None in `logprobs`).
            "logprobs_missing": got["logprobs_missing"] if got else [],
            "top_logprobs": got["top_logprobs"] if got else None,
            "finish_reason": got["finish_reason"] if got else "error",
            "error": error,
            "usage": {
                "prompt_tokens": len(ids) if got else 0,
                "completion_tokens": got["completion_tokens"] if got else 0,
            },
            "provenance": {
                "model": plan.alias,
                "revision": rev.revision,
                "revision_kind": rev.kind,
                "weights_sha256": rev.sha256,
                "adapter_revision": rev.revision if rev.kind == "adapter" else None,
                "tokenizer_sha256": facts.get("tokenizer_sha256"),
                "chat_template_sha256": (facts.get("engine") or {}).get("chat_template_sha256")
                or facts.get("hf_chat_template_sha256"),
                "engine": {
                    "kind": (facts.get("engine") or {}).get("kind"),
                    "version": (facts.get("engine") or {}).get("version"),
                    "slots": (facts.get("engine") or {}).get("slots"),
                },
                "hardware": rollout.hardware(),
                "sampling": s.describe(),
                "logprobs": LOGPROBS.get(rev.engine.kind if rev.engine else "", "")
                if got
                else None,
                "batch": got["batch"] if got else None,
                "dataset_revision": plan.dataset_revision,
            },
            "started_at": got["started_at"] if got else started,
            "finished_at": got["finished_at"] if got else time.time(),
        }
        return record

    def _at_rest(self, rec: dict[str, Any], prompt_pii: set[str]) -> dict[str, Any]:
        """The stored form: a record whose prompt or text holds PII keeps its text
        masked and no token ids (they would decode to the raw text); a prompt id or
        dataset_revision that holds PII or a credential is stored masked (the client's
        free text, as an unknown model's name is never stored raw)."""
        pid = rec["prompt_id"]
        dataset = rec["provenance"]["dataset_revision"]
        scrub_id = self._contains_pii(pid)
        scrub_dataset = dataset is not None and self._contains_pii(dataset)
        if scrub_id or scrub_dataset:
            rec = dict(rec)
            if scrub_id:
                rec["prompt_id"] = self._mask(pid)
            if scrub_dataset:
                rec["provenance"] = {**rec["provenance"], "dataset_revision": self._mask(dataset)}
        if pid not in prompt_pii and not self._contains_pii(rec["text"]):
            return rec
        stored = dict(rec)
        stored["text"] = self._mask(rec["text"])
        stored["token_ids"] = None
        stored["prompt_token_ids"] = None
        stored["pii_masked"] = True
        return stored

"""The admin API under /admin, guarded by the admin key from the environment.

Every admin action the CLI offers is the same `KeyStore` call over HTTP. Without an
admin key configured the admin API refuses everything (it never runs open).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from typing import Any

import orjson
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from switchyard.api.body import read_json
from switchyard.api.console import Sessions
from switchyard.errors import (
    AdminDisabled,
    AuthenticationError,
    InvalidAdminKey,
    InvalidRequest,
    ModelNotFound,
    PermissionDenied,
    SharedStateUnavailable,
)
from switchyard.gateway import Gateway
from switchyard.observe.cost import cost_report, parse_since
from switchyard.observe.ledger import live_summary, task_rows
from switchyard.observe.tasks import analyze_task
from switchyard.observe.traces import AmbiguousRequestId, get_request, get_task, list_requests
from switchyard.policy.auth import bearer
from switchyard.policy.keys import UPDATABLE, NotFound
from switchyard.policy.limits import period_start

log = logging.getLogger("switchyard")

_TENANT_FIELDS = (
    "rpm",
    "tpm",
    "max_concurrency",
    "budget_usd",
    "budget_period",
    "allowed_models",
    "labels",
    "task_budget",
    "priority",
)
_KEY_FIELDS = (
    *_TENANT_FIELDS,
    "name",
    "allowed_adapters",
    "may_pin_revisions",
    "may_report_device_state",
    "expires_in_s",
    "expires_at",
)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def _number(q: Any, name: str, default: float | None = None) -> float | None:
    if name not in q:
        return default
    try:
        value = float(q[name][:32])
    except ValueError:
        raise InvalidRequest(f"'{name}' must be a number", param=name) from None
    if value != value or value in (float("inf"), float("-inf")):
        raise InvalidRequest(f"'{name}' must be a finite number", param=name)
    return value


def _limit(q: Any, default: int = 100) -> int:
    n = _number(q, "limit", default)
    assert n is not None
    return max(1, min(int(n), 10_000))


def _text(q: Any, name: str) -> str | None:
    value = q.get(name)
    return None if value in (None, "") else str(value)[:256]


def require_admin(request: Request, env: str, sessions: Sessions | None = None) -> None:
    """Pass only a request with the admin key from `env` (Authorization: Bearer), or
    the console's session (and, for a change, its CSRF token). The one check of the
    admin API, /metrics and the details of /readyz, so they cannot drift apart."""
    expected = os.environ.get(env)
    if not expected:
        raise AdminDisabled(f"the admin API is disabled: set {env} to enable it")
    if (
        sessions is not None
        and "authorization" not in request.headers
        and sessions.check(request)  # the console's session (and CSRF token)
    ):
        return
    given = bearer(request.headers) or ""
    if not secrets.compare_digest(given.encode(), expected.encode()):
        raise InvalidAdminKey("invalid admin key")


def is_admin(request: Request, env: str, sessions: Sessions | None = None) -> bool:
    """Whether `require_admin` would pass: for a route that shows everyone something
    and the admin more (a GET: no CSRF token is involved)."""
    try:
        require_admin(request, env, sessions)
    except (AuthenticationError, PermissionDenied):
        return False
    return True


def build_admin_routes(gw: Gateway, sessions: Sessions | None = None) -> list[Route]:
    env = gw.settings.auth.admin_key_env

    def guard(request: Request) -> None:
        require_admin(request, env, sessions)

    def with_metrics_label(t: dict[str, Any]) -> dict[str, Any]:
        """A tenant with its name in /metrics when that is a hashed label: the admin
        finds its series there, and nobody else can."""
        if gw.metrics is not None and gw.metrics.tenant_mode == "hashed":
            t["metrics_label"] = gw.metrics.tenant_label(t["id"])
        return t

    async def body_of(request: Request, allowed: tuple[str, ...]) -> dict[str, Any]:
        body = await read_json(request, 65536)
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        unknown = sorted(set(body) - set(allowed) - {"id", "tenant_id"})
        if unknown:
            raise InvalidRequest(f"unknown field '{unknown[0]}'", param=unknown[0])
        return body

    async def tenants(request: Request) -> Response:
        """GET: every tenant with its effective limits and what its budget period has used; POST {"id", limits...}: create one."""
        guard(request)
        if request.method == "GET":
            data = gw.keys.list_tenants()
            now = time.time()
            for t in data:  # what the budget period has used so far
                with_metrics_label(t)
                lim = t["effective_limits"]
                if lim.get("budget_usd") is not None:
                    since = period_start(lim.get("budget_period") or "month", now)
                    t["budget_used_usd"] = round(
                        await gw.store.spent_since("tenant_id", t["id"], since), 6
                    )
            return _json({"object": "list", "data": data})
        body = await body_of(request, _TENANT_FIELDS)
        tenant_id = body.pop("id", None)
        if not tenant_id:
            raise InvalidRequest("'id' is required", param="id")
        return _json(gw.keys.create_tenant(tenant_id, **body), 201)

    async def tenant(request: Request) -> Response:
        """GET: one tenant, its limits, effective limits and metrics label; PATCH {limits,
        priority}: change those given (at once in this process)."""
        guard(request)
        tenant_id = request.path_params["tenant_id"]
        if request.method == "PATCH":
            body = await body_of(request, UPDATABLE)
            out = gw.keys.update_tenant(tenant_id, **body)
            gw.auth.invalidate()
            return _json(with_metrics_label(out))
        return _json(with_metrics_label(gw.keys.get_tenant(tenant_id)))

    async def keys(request: Request) -> Response:
        """GET ?tenant=: the API keys (never their secrets); POST {"tenant_id", ...}: create one (its secret is shown once)."""
        guard(request)
        if request.method == "GET":
            tenant_id = request.query_params.get("tenant")
            return _json({"object": "list", "data": gw.keys.list_keys(tenant_id)})
        body = await body_of(request, _KEY_FIELDS)
        tenant_id = body.pop("tenant_id", None)
        if not tenant_id:
            raise InvalidRequest("'tenant_id' is required", param="tenant_id")
        return _json(gw.keys.create_key(tenant_id, **body), 201)

    async def key(request: Request) -> Response:
        """GET: one API key; PATCH {limits, priority}: change those given; DELETE: revoke
        it (both at once in this process)."""
        guard(request)
        key_id = request.path_params["key_id"]
        if request.method == "PATCH":
            body = await body_of(request, UPDATABLE)
            out = gw.keys.update_key(key_id, **body)
            gw.auth.invalidate()
            return _json(out)
        if request.method == "DELETE":
            out = gw.keys.revoke_key(key_id)
            gw.auth.invalidate()
            return _json(out)
        return _json(gw.keys.get_key(key_id))

    async def revoke(request: Request) -> Response:
        """Revoke an API key (at once in this process)."""
        guard(request)
        out = gw.keys.revoke_key(request.path_params["key_id"])
        gw.auth.invalidate()  # takes effect at once in this process
        return _json(out)

    async def usage(request: Request) -> Response:
        """Ledger rows, newest first: ?tenant=&key=&task=&model=&status=&since=&before=
        &limit= (since/before: unix seconds; the next page is ?before= the last row's
        received_at)."""
        guard(request)
        await gw.service.settled()
        q = request.query_params
        limit = _limit(q)
        return _json(
            {
                "object": "list",
                "data": gw.ledger.rows(
                    tenant_id=_text(q, "tenant"),
                    key_id=_text(q, "key"),
                    task_id=_text(q, "task"),
                    limit=limit,
                    model=_text(q, "model"),
                    status=_text(q, "status"),
                    since=_number(q, "since"),
                    before=_number(q, "before"),
                ),
            }
        )

    async def task_list(request: Request) -> Response:
        """Tasks, most recently active first: ?tenant=&before=&limit=."""
        guard(request)
        await gw.service.settled()
        q = request.query_params
        data = gw.ledger.read(task_rows, _text(q, "tenant"), _limit(q), _number(q, "before"))
        return _json({"object": "list", "data": data})

    async def live(request: Request) -> Response:
        """The live view: the ledger over the last ?window_s= (60, at most 3600) seconds,
        and the gateway's state now (breakers, queues, engines)."""
        guard(request)
        await gw.service.settled()
        window = _number(request.query_params, "window_s", 60.0)
        assert window is not None
        window = min(max(window, 1.0), 3600.0)
        now_wall = time.time()
        out = gw.ledger.read(live_summary, now_wall - window, now_wall + 1e-6)
        now = time.monotonic()
        out["breakers"] = {a: b.describe(now)["state"] for a, b in gw.executor.breakers.items()}
        out["queues"] = {
            name: {"in_flight": g.in_flight, "queued": g.queued} for name, g in gw.gates.items()
        }
        out["active_requests"] = gw.service.active
        reg = gw.registry
        out["engines"] = {
            e.alias: {
                "state": e.describe()["state"],
                "in_flight": e.in_flight,
                "memory_mb": e.memory_mb,
                "adapters": {
                    n: a["state"] for n, a in (e.describe().get("adapters") or {}).items()
                },
            }
            for e in reg.managed()
        }
        out["engine_load"] = {  # what each engine last said of its own load
            d.name: d.live.engine.describe(now) for d in reg.every() if d.live.engine is not None
        }
        out["cache"] = gw.cache.stats() if gw.cache is not None else {"enabled": False}
        return _json(out)

    async def cost(request: Request) -> Response:
        """The build-vs-buy report (observe/cost.py): ?since=30d (or a date, or unix s)."""
        guard(request)
        await gw.service.settled()
        now = time.time()
        try:
            since = parse_since(request.query_params.get("since", "30d"), now)
            report = gw.ledger.read(cost_report, gw.settings.cost, since, now)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="since") from None
        return _json(report)

    async def settled() -> None:
        await gw.service.settled()  # what was answered before this call is visible

    async def request_trace(request: Request) -> Response:
        """One request's decision trace (?tenant= when the id is ambiguous)."""
        guard(request)
        rid = request.path_params["request_id"]
        tenant = request.query_params.get("tenant")
        await settled()
        with gw.store.connection() as conn:
            try:
                rec = get_request(conn, rid, tenant)
            except AmbiguousRequestId as exc:
                raise InvalidRequest(f"{exc} with ?tenant=", param="tenant") from None
        if rec is None:
            raise NotFound(f"no trace for request '{request.path_params['request_id']}'")
        return _json(rec)

    async def request_list(request: Request) -> Response:
        """?tenant=&since=(unix s)&status=&limit="""
        guard(request)
        q = request.query_params
        try:
            since = float(q["since"]) if "since" in q else None
            limit = min(int(q.get("limit", "100")), 10_000)
        except ValueError:
            raise InvalidRequest("'since' and 'limit' must be numbers") from None
        await settled()
        with gw.store.connection() as conn:
            data = list_requests(conn, q.get("tenant"), since, q.get("status"), limit)
        return _json({"object": "list", "data": data})

    async def task_trace(request: Request) -> Response:
        """GET: the task report (?tenant= narrows to one tenant's task);
        DELETE ?tenant=: cancel the tenant's task."""
        guard(request)
        task_id = request.path_params["task_id"]
        tenant = request.query_params.get("tenant")
        if request.method == "DELETE":
            if not tenant:
                raise InvalidRequest("cancelling a task needs ?tenant=", param="tenant")
            return _json(await gw.cancel_task(tenant, task_id))
        await settled()
        with gw.store.connection() as conn:
            records = get_task(conn, task_id)
        if tenant:  # task ids are the clients': one tenant's task of that id
            records = [r for r in records if r.get("tenant_id") == tenant]
        if not records:
            raise NotFound(f"no requests recorded for task '{task_id}'")
        return _json({"task": analyze_task(records), "requests": records})

    async def approvals(request: Request) -> Response:
        """{"tenant", "task_id", "call_id", "approver", "ttl_s"}: a single-use approval
        for one tool call's result (policy/tool_calls.py); the token is shown once."""
        guard(request)
        body = await body_of(request, ("tenant", "task_id", "call_id", "approver", "ttl_s"))
        out = gw.store.approvals.issue(
            body.get("tenant"),  # type: ignore[arg-type]
            body.get("task_id"),
            body.get("call_id"),  # type: ignore[arg-type]
            body.get("approver"),  # type: ignore[arg-type]
            body.get("ttl_s", gw.settings.tools.approval_ttl_s),
        )
        log.info(
            "approval issued by %s for call %s of task %s (tenant %s)",
            out["approver"],
            out["call_id"],
            out["task_id"],
            out["tenant"],
        )
        return _json(out, 201)

    async def tool_calls(request: Request) -> Response:
        """GET ?tenant=: the MCP tool calls in doubt (mcp_service/), for an operator
        to resolve; POST {"tenant", "call_id", "ran"}: resolve one (ran: repeats are
        refused as done; not ran: the record is dropped and a repeat runs it)."""
        guard(request)
        records = gw.store.tool_calls
        if request.method == "GET":
            return _json(
                {"object": "list", "data": records.in_doubt(_text(request.query_params, "tenant"))}
            )
        body = await body_of(request, ("tenant", "call_id", "ran"))
        tenant, call_id, ran = body.get("tenant"), body.get("call_id"), body.get("ran")
        if (
            not isinstance(tenant, str)
            or not isinstance(call_id, str)
            or not isinstance(ran, bool)
            or not 0 < len(tenant) <= 64  # refused, never cut: a cut id names another call
            or not 0 < len(call_id) <= 128
        ):
            raise InvalidRequest(
                "'tenant' (1 to 64 characters), 'call_id' (1 to 128) and 'ran' (boolean) "
                "are required"
            )
        if not records.resolve(tenant, call_id, ran):
            raise NotFound(f"no tool call '{call_id}' in doubt for this tenant")
        log.warning("tool call %s of tenant %s resolved: ran=%s", call_id, tenant, ran)
        return _json(
            {"object": "tool_call.resolved", "tenant": tenant, "call_id": call_id, "ran": ran}
        )

    async def cache_invalidate(request: Request) -> Response:
        """{"tenant", "model", "tag", "partition", "dry_run"}: at least one filter."""
        guard(request)
        if gw.cache is None:
            raise InvalidRequest("the cache is not enabled (cache.enabled: false)")
        body = await body_of(request, ("tenant", "model", "tag", "partition", "dry_run"))
        f = {k: body.get(k) for k in ("tenant", "model", "tag", "partition")}
        dry_run = bool(body.get("dry_run", False))
        try:
            out = gw.cache.invalidate(**f, dry_run=dry_run)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        share = gw.cache.share
        if share is not None:  # Redis and every other gateway process
            try:
                out["shared"] = await share.invalidate(f, dry_run)
            except (RedisError, OSError):
                log.warning("cache invalidation not shared: Redis unreachable", exc_info=True)
                raise SharedStateUnavailable(
                    "removed from this gateway process only: the shared cache (Redis) is "
                    "unreachable; repeat the invalidation once it is back"
                ) from None
        return _json(out)

    async def engines(request: Request) -> Response:
        """The residency pool, every managed engine (state, memory, adapters) and what
        each engine last said of its own load (engines.state_interval_s), by deployment."""
        guard(request)
        reg = gw.registry
        now = time.monotonic()
        return _json(
            {
                "pool": reg.pool.describe(),
                "engines": {e.alias: e.describe() for e in reg.managed()},
                "load": {
                    d.name: d.live.engine.describe(now)
                    for d in reg.every()
                    if d.live.engine is not None
                },
            }
        )

    def balancer(request: Request) -> Any:
        alias = request.path_params["alias"]
        b = gw.balancers.get(alias)
        if b is None:
            raise ModelNotFound(f"the model '{alias[:128]}' has no deployments to weigh")
        return b

    async def model_weights(request: Request) -> Response:
        """GET: every deployment's weight now; POST {"weights": {name: w}, "reason"}."""
        guard(request)
        b = balancer(request)
        if request.method == "POST":
            body = await body_of(request, ("weights", "reason"))
            weights = body.get("weights")
            if (
                not isinstance(weights, dict)
                or not weights
                or not all(
                    isinstance(k, str)
                    and isinstance(v, int | float)
                    and not isinstance(v, bool)
                    and 0 <= v <= 1e6
                    for k, v in weights.items()
                )
            ):
                raise InvalidRequest(
                    "'weights' must map deployment names to numbers from 0 to 1000000",
                    param="weights",
                )
            reason = body.get("reason")
            why = reason[:200] if isinstance(reason, str) and reason else "set by the admin API"
            gw.set_weights(b.alias, {k: float(v) for k, v in weights.items()}, why)
        return _json({"model": b.alias, "weights": b.weights(), "config": b.config_weights()})

    async def model_move(request: Request) -> Response:
        """promote: the canaries take all the traffic; rollback: they take none."""
        guard(request)
        b = balancer(request)
        action = request.path_params["action"]
        if not b.canaries():
            raise InvalidRequest(f"the model '{b.alias}' has no canary deployment")
        weights = b.promote() if action == "promote" else b.rollback()
        gw.set_weights(b.alias, weights, f"{action} by the admin API")
        return _json({"model": b.alias, "weights": b.weights(), "config": b.config_weights()})

    async def model_move_checked(request: Request) -> Response:
        """promote: the canaries take all the traffic; rollback: they take none."""
        if request.path_params["action"] not in ("promote", "rollback"):
            guard(request)
            raise InvalidRequest("use /admin/models/{alias}/promote or /rollback")
        return await model_move(request)

    def revisions_of(request: Request) -> Any:
        manager = gw.revisions.get(request.path_params["alias"])
        if manager is None:
            raise ModelNotFound(
                f"the model '{request.path_params['alias'][:128]}' has no managed revisions "
                "(rl.models)"
            )
        return manager

    async def wait_for(rev: Any, body: dict[str, Any], states: tuple[str, ...]) -> None:
        """Answer once the revision reached one of `states`, or after wait_s."""
        wait_s = body.get("wait_s", 0)
        if (
            isinstance(wait_s, bool)
            or not isinstance(wait_s, int | float)
            or not 0 <= wait_s <= 600
        ):
            raise InvalidRequest(
                "'wait_s' must be a number of seconds from 0 to 600", param="wait_s"
            )
        end = time.monotonic() + wait_s
        while rev.state not in states and time.monotonic() < end:
            await asyncio.sleep(0.01)

    async def revisions(request: Request) -> Response:
        """GET: the model's revisions; POST: register one (loaded, validated and, if
        asked, activated in the background; wait_s waits for the outcome)."""
        guard(request)
        manager = revisions_of(request)
        if request.method == "GET":
            return _json(manager.describe())
        body = await body_of(request, ("revision", "kind", "path", "sha256", "activate", "wait_s"))
        rev = await manager.register({k: v for k, v in body.items() if k != "wait_s"})
        target = ("active", "rejected") if body.get("activate") else ("validated", "rejected")
        await wait_for(rev, body, target)
        return _json(rev.describe(), 201)

    async def revision(request: Request) -> Response:
        """One revision of an RL-managed model: its state, checks and provenance."""
        guard(request)
        return _json(revisions_of(request).get(request.path_params["revision"]).describe())

    async def revision_activate(request: Request) -> Response:
        """Make a validated revision the one new requests lease."""
        guard(request)
        manager = revisions_of(request)
        rev = await manager.activate(request.path_params["revision"])
        return _json({**manager.describe(), "activated": rev.revision})

    async def revision_rollback(request: Request) -> Response:
        """Go back to the previously active revision."""
        guard(request)
        manager = revisions_of(request)
        rev = await manager.rollback()
        return _json({**manager.describe(), "activated": rev.revision})

    async def cache_stats(request: Request) -> Response:
        """The response cache: entries, hits by kind, the semantic checks and their state."""
        guard(request)
        return _json(gw.cache.stats() if gw.cache is not None else {"enabled": False})

    return [
        Route("/admin/cache/invalidate", cache_invalidate, methods=["POST"]),
        Route("/admin/cache/stats", cache_stats, methods=["GET"]),
        Route("/admin/engines", engines, methods=["GET"]),
        Route("/admin/models/{alias:path}/weights", model_weights, methods=["GET", "POST"]),
        Route("/admin/models/{alias:path}/revisions", revisions, methods=["GET", "POST"]),
        Route("/admin/models/{alias:path}/revisions/rollback", revision_rollback, methods=["POST"]),
        Route("/admin/models/{alias:path}/revisions/{revision}", revision, methods=["GET"]),
        Route(
            "/admin/models/{alias:path}/revisions/{revision}/activate",
            revision_activate,
            methods=["POST"],
        ),
        Route("/admin/models/{alias:path}/{action:str}", model_move_checked, methods=["POST"]),
        Route("/admin/requests", request_list, methods=["GET"]),
        Route("/admin/requests/{request_id}", request_trace, methods=["GET"]),
        Route("/admin/tasks", task_list, methods=["GET"]),
        Route("/admin/live", live, methods=["GET"]),
        Route("/admin/cost", cost, methods=["GET"]),
        Route("/admin/tasks/{task_id}", task_trace, methods=["GET", "DELETE"]),
        Route("/admin/approvals", approvals, methods=["POST"]),
        Route("/admin/tool-calls", tool_calls, methods=["GET", "POST"]),
        Route("/admin/tenants", tenants, methods=["GET", "POST"]),
        Route("/admin/tenants/{tenant_id}", tenant, methods=["GET", "PATCH"]),
        Route("/admin/keys", keys, methods=["GET", "POST"]),
        Route("/admin/keys/{key_id}", key, methods=["GET", "PATCH", "DELETE"]),
        Route("/admin/keys/{key_id}/revoke", revoke, methods=["POST"]),
        Route("/admin/usage", usage, methods=["GET"]),
    ]

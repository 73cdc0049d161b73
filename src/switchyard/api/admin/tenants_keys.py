"""/admin/tenants and /admin/keys: the `KeyStore` calls the CLI makes (cli/keys.py),
over HTTP; a change takes effect at once in this process and, through Redis, in every
other gateway process that shares it (state/keys_redis.py)."""

from __future__ import annotations

import time
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from switchyard.api.admin.guard import Guard
from switchyard.api.admin.params import as_json, off_loop, query_limit, query_text, read_fields
from switchyard.errors import InvalidRequest, NotFound
from switchyard.observe.metrics import Metrics
from switchyard.policy.auth import Authenticator
from switchyard.state.keys import TENANT_ID, UPDATABLE, KeyStore
from switchyard.state.limits import period_start
from switchyard.state.store import Store

TENANT_FIELDS = (
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
KEY_FIELDS = (
    *TENANT_FIELDS,
    "name",
    "allowed_adapters",
    "may_pin_revisions",
    "may_report_device_state",
    "expires_in_s",
    "expires_at",
)


PAGE, MAX_PAGE = 100, 1000  # tenants or keys a list answers: by default, at most
MAX_ID = 64  # a tenant's id is at most 63 characters, a key's 16: longer names none


def path_id(request: Request, name: str, what: str) -> str:
    """The `{name}` of the path; one longer than any id names nothing (404), and is
    never echoed whole into the answer."""
    ident = str(request.path_params[name])
    if len(ident) > MAX_ID:
        raise NotFound(f"no {what} has the id '{ident[:MAX_ID]}...'")
    return ident


def page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    """A list reply as OpenAI's lists are: its rows, the first and last ids (`?after=`
    the last for the next page) and whether more follow."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


class KeyServices(Protocol):
    keys: KeyStore
    store: Store  # what a budget period has spent
    auth: Authenticator  # its cache of verified keys, dropped on a change
    metrics: Metrics | None


class TenantsKeys:
    """Tenants and their API keys."""

    def __init__(self, services: KeyServices, guard: Guard) -> None:
        self.s = services
        self.guard = guard

    def with_metrics_label(self, t: dict[str, Any]) -> dict[str, Any]:
        """A tenant with its name in /metrics when that is a hashed label: the admin
        finds its series there, and nobody else can."""
        metrics = self.s.metrics
        if metrics is not None and metrics.tenant_mode == "hashed":
            t["metrics_label"] = metrics.tenant_label(t["id"])
        return t

    async def tenants(self, request: Request) -> Response:
        """GET ?limit=&after=: a page of tenants with their effective limits and what
        their budget periods have used; POST {"id", limits...}: create one."""
        self.guard(request)
        keys = self.s.keys
        if request.method == "GET":
            limit = query_limit(request.query_params, PAGE, MAX_PAGE)
            data = await off_loop(
                "the tenants",
                keys.list_tenants,
                limit + 1,
                query_text(request.query_params, "after"),
            )
            more = len(data) > limit
            data = data[:limit]
            now = time.time()
            for t in data:  # what the budget period has used so far
                self.with_metrics_label(t)
                lim = t["effective_limits"]
                if lim.get("budget_usd") is not None:
                    since = period_start(lim.get("budget_period") or "month", now)
                    t["budget_used_usd"] = round(
                        await self.s.store.spent_since("tenant_id", t["id"], since), 6
                    )
            return as_json(page(data, more))
        body = await read_fields(request, ("id", *TENANT_FIELDS))
        tenant_id = body.pop("id", None)
        if not tenant_id:
            raise InvalidRequest("'id' is required", param="id")
        # The whole id: `TENANT_ID.match` alone takes a trailing newline (`$`).
        if not isinstance(tenant_id, str) or not TENANT_ID.fullmatch(tenant_id):
            raise InvalidRequest("tenant id must be 1-63 chars of a-z, 0-9, '-' or '_'", param="id")
        return as_json(await off_loop("the new tenant", keys.create_tenant, tenant_id, **body), 201)

    async def tenant(self, request: Request) -> Response:
        """GET: one tenant, its limits, effective limits and metrics label; PATCH {limits,
        priority}: change those given (at once: Authenticator.changed)."""
        self.guard(request)
        tenant_id = path_id(request, "tenant_id", "tenant")
        if request.method == "PATCH":
            body = await read_fields(request, UPDATABLE)
            out = await off_loop("the tenant", self.s.keys.update_tenant, tenant_id, **body)
            await self.s.auth.changed()
            return as_json(self.with_metrics_label(out))
        tenant = await off_loop("the tenant", self.s.keys.get_tenant, tenant_id)
        return as_json(self.with_metrics_label(tenant))

    async def keys(self, request: Request) -> Response:
        """GET ?tenant=&limit=&after=: a page of API keys (never their secrets); POST
        {"tenant_id", ...}: create one (its secret is shown once)."""
        self.guard(request)
        if request.method == "GET":
            q = request.query_params
            limit = query_limit(q, PAGE, MAX_PAGE)
            data = await off_loop(
                "the keys",
                self.s.keys.list_keys,
                query_text(q, "tenant"),
                limit + 1,
                query_text(q, "after"),
            )
            return as_json(page(data[:limit], len(data) > limit))
        body = await read_fields(request, ("tenant_id", *KEY_FIELDS))
        tenant_id = body.pop("tenant_id", None)
        if not tenant_id or not isinstance(tenant_id, str):
            raise InvalidRequest("'tenant_id' is required: a tenant's id", param="tenant_id")
        return as_json(
            await off_loop("the new key", self.s.keys.create_key, tenant_id, **body), 201
        )

    async def key(self, request: Request) -> Response:
        """GET: one API key; PATCH {limits, priority}: change those given; DELETE: revoke
        it (both at once: Authenticator.changed)."""
        self.guard(request)
        key_id = path_id(request, "key_id", "key")
        if request.method == "PATCH":
            body = await read_fields(request, UPDATABLE)
            out = await off_loop("the key", self.s.keys.update_key, key_id, **body)
            await self.s.auth.changed()
            return as_json(out)
        if request.method == "DELETE":
            out = await off_loop("the key", self.s.keys.revoke_key, key_id)
            await self.s.auth.changed()
            return as_json(out)
        return as_json(await off_loop("the key", self.s.keys.get_key, key_id))

    async def revoke(self, request: Request) -> Response:
        """Revoke an API key (at once: Authenticator.changed)."""
        self.guard(request)
        out = await off_loop("the key", self.s.keys.revoke_key, path_id(request, "key_id", "key"))
        await self.s.auth.changed()
        return as_json(out)

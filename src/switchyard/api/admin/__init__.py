"""The admin API under /admin, guarded by the admin key from the environment.

One module per resource, each a small class built with the services it reads (a
Protocol naming them, which the Gateway satisfies) whose methods are the routes:

    tenants_keys.py  /admin/tenants, /admin/keys
    usage.py         /admin/usage, /admin/cost
    traces.py        /admin/requests
    tasks.py         /admin/tasks
    live.py          /admin/live
    approvals.py     /admin/approvals, /admin/tool-calls
    cache.py         /admin/cache
    engines.py       /admin/engines, /admin/models/{alias}/weights, /promote, /rollback
    revisions.py     /admin/models/{alias}/revisions
    guard.py         the admin check (require_admin, is_admin)
    params.py        the JSON reply, query parameters, JSON object bodies

Every admin action the CLI offers is the same in-process call (`KeyStore`, the
approval store, the cache) the route makes. Without an admin key configured the
admin API refuses everything (it never runs open).
"""

from __future__ import annotations

from starlette.routing import Route

from switchyard.api.admin.approvals import Approvals
from switchyard.api.admin.cache import Cache
from switchyard.api.admin.engines import Engines
from switchyard.api.admin.guard import admin_guard, is_admin, require_admin
from switchyard.api.admin.live import Live
from switchyard.api.admin.revisions import Revisions
from switchyard.api.admin.tasks import Tasks
from switchyard.api.admin.tenants_keys import TenantsKeys
from switchyard.api.admin.traces import Traces
from switchyard.api.admin.usage import Usage
from switchyard.api.console import Sessions
from switchyard.gateway import Gateway

__all__ = ["build_admin_routes", "is_admin", "require_admin"]


def build_admin_routes(gw: Gateway, sessions: Sessions | None = None) -> list[Route]:
    """The admin routes over `gw`'s services, in the order they are matched (a
    revision's path before the catch-all /admin/models/{alias}/{action})."""
    guard = admin_guard(gw.settings.auth.admin_key_env, sessions)
    cache = Cache(gw, guard)
    engines = Engines(gw, guard)
    revisions = Revisions(gw, guard)
    traces = Traces(gw, guard)
    tasks = Tasks(gw, guard)
    usage = Usage(gw, guard)
    approvals = Approvals(gw, guard)
    tenants = TenantsKeys(gw, guard)
    live = Live(gw, guard)
    models = "/admin/models/{alias:path}"
    return [
        Route("/admin/cache/invalidate", cache.cache_invalidate, methods=["POST"]),
        Route("/admin/cache/stats", cache.cache_stats, methods=["GET"]),
        Route("/admin/engines", engines.engines, methods=["GET"]),
        Route(f"{models}/weights", engines.model_weights, methods=["GET", "POST"]),
        Route(f"{models}/revisions", revisions.revisions, methods=["GET", "POST"]),
        Route(f"{models}/revisions/rollback", revisions.revision_rollback, methods=["POST"]),
        Route(f"{models}/revisions/{{revision}}", revisions.revision, methods=["GET"]),
        Route(
            f"{models}/revisions/{{revision}}/activate",
            revisions.revision_activate,
            methods=["POST"],
        ),
        Route(f"{models}/{{action:str}}", engines.model_move_checked, methods=["POST"]),
        Route("/admin/requests", traces.request_list, methods=["GET"]),
        Route("/admin/requests/{request_id}", traces.request_trace, methods=["GET"]),
        Route("/admin/tasks", tasks.task_list, methods=["GET"]),
        Route("/admin/live", live.live, methods=["GET"]),
        Route("/admin/cost", usage.cost, methods=["GET"]),
        Route("/admin/tasks/{task_id}", tasks.task_trace, methods=["GET", "DELETE"]),
        Route("/admin/approvals", approvals.approvals, methods=["POST"]),
        Route("/admin/tool-calls", approvals.tool_calls, methods=["GET", "POST"]),
        Route("/admin/tenants", tenants.tenants, methods=["GET", "POST"]),
        Route("/admin/tenants/{tenant_id}", tenants.tenant, methods=["GET", "PATCH"]),
        Route("/admin/keys", tenants.keys, methods=["GET", "POST"]),
        Route("/admin/keys/{key_id}", tenants.key, methods=["GET", "PATCH", "DELETE"]),
        Route("/admin/keys/{key_id}/revoke", tenants.revoke, methods=["POST"]),
        Route("/admin/usage", usage.usage, methods=["GET"]),
    ]

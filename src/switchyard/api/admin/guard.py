"""The admin check: the admin key from the environment, or the console's session.

One check for the admin API, /metrics and the details of /readyz, so they cannot
drift apart. Without an admin key configured the admin API refuses everything (it
never runs open).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable

from starlette.requests import Request

from switchyard.api.body import header_map
from switchyard.api.console import Sessions
from switchyard.errors import AdminDisabled, AuthenticationError, InvalidAdminKey, PermissionDenied
from switchyard.policy.auth import bearer, repeated_credential

Guard = Callable[[Request], None]  # raises unless the request is the admin's


def require_admin(request: Request, env: str, sessions: Sessions | None = None) -> None:
    """Pass only a request with the admin key from `env` (Authorization: Bearer), or
    the console's session (and, for a change, its CSRF token). The one check of the
    admin API, /metrics and the details of /readyz, so they cannot drift apart. An
    `Authorization` sent on two lines is refused 401 whatever they hold (api/body.py
    `header_map`, policy/auth.py `repeated_credential`: the model endpoints' rule)."""
    expected = os.environ.get(env)
    if not expected:
        raise AdminDisabled(f"the admin API is disabled: set {env} to enable it")
    headers = header_map(request.scope)  # names a credential header sent on two lines
    repeated = repeated_credential(headers)
    if repeated is not None:  # two credentials: neither is heard (as on every endpoint)
        raise InvalidAdminKey(
            f"the '{repeated}' header is sent more than once: send one credential"
        )
    if (
        sessions is not None
        and "authorization" not in headers
        and sessions.check(request)  # the console's session (and CSRF token)
    ):
        return
    given = bearer(headers) or ""
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


def admin_guard(env: str, sessions: Sessions | None = None) -> Guard:
    """The check every admin route makes first."""

    def guard(request: Request) -> None:
        require_admin(request, env, sessions)

    return guard

"""The operators' web console at /console: server-rendered page shells and one small
script (console_assets/) that reads and writes only through the admin API.

Sessions. Logging in with the admin key gives a session cookie (HttpOnly,
SameSite=Strict, Secure over HTTPS, 8 hours) that the admin API accepts in place of
the key; the key itself never reaches a URL or the browser's storage. The cookie is
signed with the admin key (HMAC-SHA256 over its expiry and a nonce), so every gateway
process sharing the key accepts it, and changing the key ends every session. Logging
out ends it in this process (other processes keep it until it expires: stated in the
docs/operations/security.md).

CSRF. A state-changing admin call made with the cookie must carry `X-CSRF-Token`, a
second HMAC of the same session that the page shell embeds; a cross-site page can
neither read it nor (SameSite=Strict) send the cookie. A call with an Origin header
from another origin is refused too.

Login throttling. At most LOGIN_FAILURES wrong keys per client address in any
LOGIN_WINDOW_S; past that the address gets 429 with Retry-After (the seconds until its
oldest counted failure leaves the window) and its attempts are not checked at all, so a
guesser learns nothing, not even from a right guess. The address is the socket's peer:
forwarded headers (X-Forwarded-For, Forwarded) are not trusted, since any client can
write them; behind a reverse proxy every client therefore shares the proxy's address
and the limit applies to the proxy as a whole. Other addresses, the operator's among
them, log in as usual meanwhile; the throttled address itself waits at most one window.
Each process counts its own (with N workers, N times the limit); every failure is
logged at WARNING with the address, never the key.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import hmac
import html
import logging
import math
import os
import secrets
import time
from importlib import resources
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from switchyard.api.body import read_body
from switchyard.errors import CsrfFailed, RouteNotFound

log = logging.getLogger("switchyard.console")

COOKIE = "sy_console"
CSRF_HEADER = "x-csrf-token"
SESSION_S = 8 * 3600
LOGIN_FAILURES = 10  # wrong admin keys per client address ...
LOGIN_WINDOW_S = 60.0  # ... in any window this long
_MAX_LOGIN_ADDRESSES = 10_000  # addresses with failures in the window, kept at most
_MAX_COOKIE = 256
_SAFE = ("GET", "HEAD", "OPTIONS")
PAGES = {
    "requests": "Requests",
    "tasks": "Tasks",
    "live": "Live",
    "tenants": "Tenants and keys",
    "cache": "Cache",
    "cost": "Cost",
}
_ASSETS = {"console.js": "text/javascript", "console.css": "text/css"}
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _mac(key: str, purpose: str, expiry: int, nonce: str) -> str:
    msg = f"{purpose}|{expiry}|{nonce}".encode()
    return _b64(hmac.new(key.encode(), msg, hashlib.sha256).digest())


class Sessions:
    """Signed console sessions for the admin key in `env` (see the module doc)."""

    def __init__(self, env: str) -> None:
        self.env = env
        self._ended: dict[str, int] = {}  # nonce -> expiry, logged out here

    def _key(self) -> str | None:
        return os.environ.get(self.env) or None

    def issue(self, now: float | None = None) -> str:
        key = self._key()
        assert key is not None
        expiry = int((time.time() if now is None else now) + SESSION_S)
        nonce = _b64(secrets.token_bytes(16))
        return f"{expiry}.{nonce}.{_mac(key, 'session', expiry, nonce)}"

    def _parts(self, cookie: str | None) -> tuple[str, int, str] | None:
        """(key, expiry, nonce) of a valid, unexpired, not ended session cookie."""
        key = self._key()
        if key is None or not cookie or len(cookie) > _MAX_COOKIE:
            return None
        parts = cookie.split(".")
        # ASCII digits only: `str.isdigit` also holds for '²' and other digits that
        # `int` refuses, which would fail every route that reads the session (a 500).
        digits = parts[0] if len(parts) == 3 else ""
        if not (digits.isascii() and digits.isdigit()) or len(digits) > 12:
            return None
        expiry, nonce, sig = int(parts[0]), parts[1], parts[2]
        if not hmac.compare_digest(sig.encode(), _mac(key, "session", expiry, nonce).encode()):
            return None
        if expiry < time.time() or nonce in self._ended:
            return None
        return key, expiry, nonce

    def csrf(self, request: Request) -> str | None:
        """The CSRF token of the request's session, or None without a valid one."""
        got = self._parts(request.cookies.get(COOKIE))
        if got is None:
            return None
        key, expiry, nonce = got
        return _mac(key, "csrf", expiry, nonce)

    def end(self, request: Request) -> None:
        got = self._parts(request.cookies.get(COOKIE))
        if got is None:
            return
        now = time.time()
        self._ended = {n: e for n, e in self._ended.items() if e > now}
        if len(self._ended) < 100_000:
            self._ended[got[2]] = got[1]

    def check(self, request: Request) -> bool:
        """Whether the request is an authorized console call: a valid session, and for
        a change its CSRF token and no foreign Origin. False: no session (the caller
        falls back to the bearer key); a session without the token raises 403."""
        token = self.csrf(request)
        if token is None:
            return False
        if request.method in _SAFE:
            return True
        origin = request.headers.get("origin")
        if origin is not None and origin != _own_origin(request):
            raise CsrfFailed("cross-origin console request refused")
        given = request.headers.get(CSRF_HEADER, "")[:128]
        if not given or not hmac.compare_digest(given.encode(), token.encode()):
            raise CsrfFailed("missing or wrong CSRF token (X-CSRF-Token) for a console change")
        return True


class LoginThrottle:
    """Failed console logins per client address over a sliding window (module doc).

    Memory is bounded: each address keeps at most `limit` failure times, and at most
    `max_addresses` addresses are kept (expired ones dropped first, then the least
    recently failing), so a flood from many addresses costs a bounded table."""

    def __init__(
        self,
        limit: int = LOGIN_FAILURES,
        window_s: float = LOGIN_WINDOW_S,
        max_addresses: int = _MAX_LOGIN_ADDRESSES,
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self.max_addresses = max_addresses
        # address -> monotonic times of its failures within the window, oldest first;
        # insertion order = least recently failing first (moved to the end on failure).
        self._failures: dict[str, collections.deque[float]] = {}

    def retry_after(self, address: str, now: float) -> int | None:
        """Whole seconds until `address` may try again, or None if it may now."""
        times = self._failures.get(address)
        if times is None:
            return None
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if not times:
            del self._failures[address]
            return None
        if len(times) < self.limit:
            return None
        return max(1, math.ceil(times[0] + self.window_s - now))

    def failed(self, address: str, now: float) -> int:
        """Count a wrong key from `address`; how many it has in the window now."""
        times = self._failures.pop(address, None)
        if times is None:
            times = collections.deque(maxlen=self.limit)
            if len(self._failures) >= self.max_addresses:
                self._make_room(now)
        times.append(now)
        self._failures[address] = times  # now the most recently failing
        return len(times)

    def succeeded(self, address: str) -> None:
        """The right key: the address starts afresh."""
        self._failures.pop(address, None)

    def _make_room(self, now: float) -> None:
        cutoff = now - self.window_s
        for address in [a for a, t in self._failures.items() if not t or t[-1] <= cutoff]:
            del self._failures[address]
        while len(self._failures) >= self.max_addresses:
            del self._failures[next(iter(self._failures))]


def client_address(request: Request) -> str:
    """The socket peer's address: what login throttling counts by (module doc)."""
    client = request.client
    return client.host if client is not None else "unknown"


def _own_origin(request: Request) -> str:
    host = request.headers.get("host", "")[:256]
    return f"{request.url.scheme}://{host}"


def _page(title: str, body: str, csrf: str | None = None, page: str = "", arg: str = "") -> str:
    nav = ""
    if csrf is not None:
        links = "".join(
            f'<a href="/console/{p}"{" class=here" if p == page else ""}>{html.escape(t)}</a>'
            for p, t in PAGES.items()
        )
        nav = (
            f'<nav><span class="brand">Switchyard</span>{links}'
            '<form method="post" action="/console/logout" class="logout">'
            f'<input type="hidden" name="csrf" value="{html.escape(csrf)}">'
            '<button type="submit" id="logout">Log out</button></form></nav>'
        )
    meta = f'<meta name="csrf-token" content="{html.escape(csrf)}">' if csrf else ""
    script = '<script src="/console/static/console.js"></script>' if csrf else ""
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>Switchyard console · {html.escape(title)}</title>{meta}"
        '<link rel="stylesheet" href="/console/static/console.css"></head>'
        f'<body data-page="{html.escape(page)}" data-arg="{html.escape(arg)}">{nav}'
        f"<main><h1>{html.escape(title)}</h1>{body}</main>{script}</body></html>"
    )


def _html(text: str, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        text,
        status_code=status,
        media_type="text/html; charset=utf-8",
        headers={**_HEADERS, **(headers or {})},
    )


def _login_form(message: str = "") -> str:
    note = f'<p class="error" id="login-error">{html.escape(message)}</p>' if message else ""
    return (
        f'{note}<form method="post" action="/console/login" class="login">'
        '<label>Admin key <input type="password" name="admin_key" id="admin-key" '
        'autocomplete="current-password" required maxlength="512"></label>'
        '<button type="submit" id="login">Log in</button></form>'
        "<p class=hint>The key is the one in the gateway's admin key variable "
        "(auth.admin_key_env). It is sent once, in this form; the browser keeps only "
        "a session cookie.</p>"
    )


def _redirect(to: str, headers: dict[str, str] | None = None) -> Response:
    r = RedirectResponse(to, status_code=303)
    for k, v in {**_HEADERS, **(headers or {})}.items():
        r.headers[k] = v
    return r


async def _form_field(request: Request, name: str) -> str:
    """One field of a small url-encoded form body (4 KiB at most; "" when absent)."""
    raw = await read_body(request, 4096, timeout_s=10.0)
    try:
        form = parse_qs(raw.decode("utf-8"), max_num_fields=8)
    except (UnicodeDecodeError, ValueError):
        form = {}
    return (form.get(name) or [""])[0]


def build_console_routes(sessions: Sessions, throttle: LoginThrottle | None = None) -> list[Route]:
    logins = throttle if throttle is not None else LoginThrottle()

    async def login(request: Request) -> Response:
        if request.method == "GET":
            if sessions.csrf(request) is not None:
                return _redirect("/console/requests")
            return _html(_page("Log in", _login_form()))
        expected = sessions._key()
        if expected is None:
            return _html(
                _page("Log in", _login_form(f"the admin API is disabled: set {sessions.env}")),
                403,
            )
        given = await _form_field(request, "admin_key")
        # From here to counting a failure nothing awaits, so concurrent attempts from
        # one address cannot all pass the check before any of them is counted.
        address = client_address(request)
        wait_s = logins.retry_after(address, time.monotonic())
        if wait_s is not None:  # the key is not checked: a right guess shows nothing
            message = f"too many wrong admin keys from this address; try again in {wait_s} s"
            return _html(_page("Log in", _login_form(message)), 429, {"Retry-After": str(wait_s)})
        if not secrets.compare_digest(given.encode(), expected.encode()):
            count = logins.failed(address, time.monotonic())
            log.warning(
                "console login with a wrong admin key from %s (%d in the last %.0f s%s)",
                address[:64],
                count,
                logins.window_s,
                "; further attempts refused until the window frees"
                if count >= logins.limit
                else "",
            )
            return _html(_page("Log in", _login_form("wrong admin key")), 401)
        logins.succeeded(address)
        secure = "; Secure" if request.url.scheme == "https" else ""
        cookie = (
            f"{COOKIE}={sessions.issue()}; Path=/; Max-Age={SESSION_S}; HttpOnly; "
            f"SameSite=Strict{secure}"
        )
        return _redirect("/console/requests", {"Set-Cookie": cookie})

    async def logout(request: Request) -> Response:
        token = sessions.csrf(request)
        given = await _form_field(request, "csrf")
        if token is not None:
            if not hmac.compare_digest(given.encode(), token.encode()):
                raise CsrfFailed("missing or wrong CSRF token")
            sessions.end(request)
        gone = f"{COOKIE}=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict"
        return _redirect("/console/login", {"Set-Cookie": gone})

    async def page(request: Request) -> Response:
        name = request.path_params.get("page", "requests")
        arg = request.path_params.get("arg", "")[:256]
        if name not in PAGES or (arg and name not in ("requests", "tasks")):
            raise RouteNotFound(f"no console page {request.url.path[:200]}")
        csrf = sessions.csrf(request)
        if csrf is None:
            return _redirect("/console/login")
        title = PAGES[name]
        if arg:
            title = ("Request " if name == "requests" else "Task ") + arg
        body = '<div id="content" aria-live="polite">Loading…</div>'
        return _html(_page(title, body, csrf, name, arg))

    async def root(request: Request) -> Response:
        return _redirect("/console/requests")

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in _ASSETS:
            raise RouteNotFound("no such console asset")
        data = resources.files("switchyard.api").joinpath("console_assets", name).read_bytes()
        return Response(data, media_type=_ASSETS[name], headers=_HEADERS)

    return [
        Route("/console", root, methods=["GET"]),
        Route("/console/login", login, methods=["GET", "POST"]),
        Route("/console/logout", logout, methods=["POST"]),
        Route("/console/static/{name}", asset, methods=["GET"]),
        Route("/console/{page}", page, methods=["GET"]),
        Route("/console/{page}/{arg:path}", page, methods=["GET"]),
    ]

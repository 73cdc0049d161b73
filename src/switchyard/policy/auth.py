"""Authentication and model authorization.

A bearer key is verified against the key store (hash lookup) and the resulting
`Principal` cached briefly, so the hot path does not touch SQLite on every request.
Authorization of the model is separate: a valid key may still not use a model.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from switchyard.errors import AuthenticationError, ModelNotAllowed
from switchyard.identity import ANONYMOUS, Principal
from switchyard.outcomes import Authenticate

if TYPE_CHECKING:
    from switchyard.state.keys_redis import KeyChanges

MAX_AUTHORIZATION = 512  # our keys are ~50 characters; a longer value is not one


def bearer(headers: Mapping[str, str]) -> str | None:
    value = headers.get("authorization")
    if not value or len(value) > MAX_AUTHORIZATION:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def api_key_header(headers: Mapping[str, str]) -> str | None:
    """The key of an `x-api-key` header (the Anthropic protocol's), bounded as a bearer's."""
    value = headers.get("x-api-key")
    if not value or len(value) > MAX_AUTHORIZATION or not value.strip():
        return None
    return value.strip()


def repeated_credential(headers: Mapping[str, str], x_api_key: bool = False) -> str | None:
    """The credential header the request sent on more than one line, or None. Two
    lines are two credentials: neither may be heard alone. api/body.py `header_map`
    names them (`repeated_credentials`, an attribute of its dict; any other mapping
    has none). `x_api_key`: `x-api-key` is a credential too (the Anthropic protocol)."""
    for name in getattr(headers, "repeated_credentials", ()):
        if name == "authorization" or (x_api_key and name == "x-api-key"):
            return str(name)
    return None


Verdict = tuple[tuple[Authenticate, str], dict[str, Any]]


class Authenticator:
    """`verify(token)` looks a key up in the store (awaitable: the store runs it off
    the event loop); its answer is cached for `cache_s`, so the hot path touches no
    store at all, and a lookup that has to wait delays only its own request."""

    def __init__(
        self,
        verify: Callable[[str], Awaitable[Principal | str]],
        cache_s: float,
        changes: KeyChanges | None = None,
        disabled: bool = False,
    ) -> None:
        self._verify = verify
        self.disabled = disabled  # auth.mode: disabled (every caller is ANONYMOUS)
        self.cache_s = cache_s
        self.changes = changes  # other processes sharing Redis: told of each change
        self._generation = 0  # one more at each forgetting (a lookup under way is stale)
        self._cache: dict[str, tuple[float, Principal | str]] = {}
        # The authenticate decision's verdict and evidence per (tenant, key, anonymous).
        self._verdicts: dict[tuple[str, str, bool], Verdict] = {}

    def verdict(self, principal: Principal) -> Verdict:
        """((outcome, reason), evidence) of the request's authenticate decision."""
        who = (principal.tenant_id, principal.key_id, principal is ANONYMOUS)
        verdict = self._verdicts.get(who)
        if verdict is None:
            verdict = (
                (Authenticate.SKIP, "auth.mode is disabled")
                if principal is ANONYMOUS
                else (Authenticate.OK, "valid API key"),
                {"tenant": principal.tenant_id, "key": principal.key_id},
            )
            if len(self._verdicts) >= 4096:  # principals are re-read as keys change
                self._verdicts.clear()
            self._verdicts[who] = verdict
        return verdict

    def invalidate(self) -> None:
        """Forget every verified key (this process)."""
        self._cache.clear()
        self._generation += 1

    async def changed(self) -> None:
        """Keys or tenants changed (the admin API): this process forgets every verified
        key at once, and every other process sharing Redis is told to."""
        self.invalidate()
        if self.changes is not None:
            await self.changes.publish()

    def authenticate(
        self, headers: Mapping[str, str], x_api_key: bool = False
    ) -> Principal | Awaitable[Principal]:
        """The caller's principal when its key is cached, else an awaitable of it;
        raises (or the awaitable raises) 401 for a missing or refused key.
        `x_api_key`: the key may also come as `x-api-key` (the Anthropic protocol).
        With `auth.mode: disabled`, every caller is ANONYMOUS."""
        if self.disabled:
            return ANONYMOUS
        repeated = repeated_credential(headers, x_api_key)
        if repeated is not None:
            raise AuthenticationError(
                f"the '{repeated}' header is sent more than once: send one credential"
            )
        token = bearer(headers)
        if token is None and x_api_key:
            token = api_key_header(headers)
        if token is None:
            raise AuthenticationError(
                "missing API key: send 'x-api-key: <key>' or 'Authorization: Bearer <key>'"
                if x_api_key
                else "missing API key: send 'Authorization: Bearer <key>'"
            )
        hit = self._cache.get(token)
        if hit is not None and hit[0] > time.monotonic():
            return _accepted(hit[1])
        return self._lookup(token)

    async def _lookup(self, token: str) -> Principal:
        generation = self._generation
        result = await self._verify(token)
        if generation == self._generation:  # else a change came while it was read
            if len(self._cache) > 10_000:
                self._cache.clear()
            ttl = self.cache_s
            if isinstance(result, Principal) and result.expires_at is not None:
                ttl = min(ttl, result.expires_at - time.time())  # refused once it expires
            self._cache[token] = (time.monotonic() + ttl, result)
        return _accepted(result)


def _accepted(result: Principal | str) -> Principal:
    if isinstance(result, str):
        raise AuthenticationError(result)
    return result


def authorize_model(principal: Principal, alias: str) -> None:
    if not principal.may_use(alias):
        raise ModelNotAllowed(f"this key may not use the model '{alias}'", param="model")

"""Authentication and model authorization.

A bearer key is verified against the key store (hash lookup) and the resulting
`Principal` cached briefly, so the hot path does not touch SQLite on every request.
Authorization of the model is separate: a valid key may still not use a model.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from switchyard.errors import AuthenticationError, PermissionDenied
from switchyard.policy.keys import KeyStore, Limits, Principal

# Who calls when auth.mode is disabled: no key, no limits of its own.
ANONYMOUS = Principal(
    tenant_id="anonymous",
    key_id="none",
    key_models=("*",),
    tenant_models=("*",),
    key_limits=Limits(),
    tenant_limits=Limits(),
)


MAX_AUTHORIZATION = 512  # our keys are ~50 characters; a longer value is not one


def bearer(headers: Mapping[str, str]) -> str | None:
    value = headers.get("authorization")
    if not value or len(value) > MAX_AUTHORIZATION:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class Authenticator:
    def __init__(self, store: KeyStore, cache_s: float) -> None:
        self.store = store
        self.cache_s = cache_s
        self._cache: dict[str, tuple[float, Principal | str]] = {}

    def invalidate(self) -> None:
        self._cache.clear()

    def authenticate(self, headers: Mapping[str, str]) -> Principal:
        token = bearer(headers)
        if token is None:
            raise AuthenticationError(
                "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        now = time.monotonic()
        hit = self._cache.get(token)
        if hit is not None and hit[0] > now:
            result = hit[1]
        else:
            result = self.store.verify(token)
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[token] = (now + self.cache_s, result)
        if isinstance(result, str):
            raise AuthenticationError(result, code="invalid_api_key")
        return result


def authorize_model(principal: Principal, alias: str) -> None:
    if not principal.may_use(alias):
        raise PermissionDenied(
            f"this key may not use the model '{alias}'", param="model", code="model_not_allowed"
        )

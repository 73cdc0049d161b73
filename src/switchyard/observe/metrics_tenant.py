"""The metrics' tenant label: the tenant id, a keyed hash of it, or none.

`observe.metrics_tenant_label` picks the mode; this module owns what the `hashed` mode
needs: the HMAC that names a tenant's series and the key it is made with.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Literal

from switchyard.config import ConfigError, Settings

TenantLabel = Literal["id", "hashed", "off"]
NO_TENANT = "none"  # the label of a request refused before it had a principal
_HASH_HEX = 12  # 48 bits: no collision in practice among admin-created tenants


def hashed_tenant(key: bytes, tenant_id: str) -> str:
    """The `hashed` label of a tenant: an HMAC, so that the series stay apart and keep
    their names across restarts and processes, while a reader without the key can
    neither map one back to a customer nor confirm a guessed tenant id (a plain hash
    of a guessable id would do both)."""
    return "t_" + hmac.new(key, tenant_id.encode(), hashlib.sha256).hexdigest()[:_HASH_HEX]


def tenant_key(settings: Settings) -> bytes | None:
    """The key of the `hashed` tenant label (None for the other modes): from
    observe.metrics_tenant_key_env, else the admin key. Raises ConfigError at start
    when neither is set, rather than hashing with a key no other process shares."""
    obs = settings.observe
    if obs.metrics_tenant_label != "hashed":
        return None
    secret = os.environ.get(obs.metrics_tenant_key_env) or os.environ.get(
        settings.auth.admin_key_env
    )
    if not secret:
        raise ConfigError(
            "observe.metrics_tenant_label: 'hashed' needs a key: set "
            f"{obs.metrics_tenant_key_env} (or the admin key, {settings.auth.admin_key_env})"
        )
    return secret.encode()

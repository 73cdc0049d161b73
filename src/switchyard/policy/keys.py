"""Tenants and API keys: moved to state/keys.py; this module keeps the old
import path."""

from switchyard.state.keys import (
    KEY_PREFIX,
    LIMIT_FIELDS,
    MAX_LIMIT,
    TASK_BUDGET_FIELDS,
    TENANT_ID,
    UPDATABLE,
    KeyStore,
    Limits,
    NotFound,
    Principal,
    _check_limits,
    _check_priority,
    _check_task_budget,
    _limits,
    _patterns,
    _rank,
    _task_budget,
    hash_key,
)

__all__ = [
    "KEY_PREFIX",
    "LIMIT_FIELDS",
    "MAX_LIMIT",
    "TASK_BUDGET_FIELDS",
    "TENANT_ID",
    "UPDATABLE",
    "KeyStore",
    "Limits",
    "NotFound",
    "Principal",
    "_check_limits",
    "_check_priority",
    "_check_task_budget",
    "_limits",
    "_patterns",
    "_rank",
    "_task_budget",
    "hash_key",
]

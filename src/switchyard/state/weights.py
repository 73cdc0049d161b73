"""Deployment weights set at run time (promote, rollback, the canary guard, the admin
API), kept in the store so they survive restarts and are shared by every gateway
process using it. A stored weight overrides the config's for that deployment; a
deployment with no stored row has its configured weight.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Collection, Mapping
from typing import Any, Literal

REFRESH_S = 2.0  # how often a gateway reads the weights others may have set


def canary_weights(
    action: Literal["promote", "rollback"],
    configured: Mapping[str, float],
    canaries: Collection[str],
) -> dict[str, float]:
    """The weights a promote or a rollback sets, by deployment name: promote gives the
    canaries all the traffic (the others 0); rollback gives them none and the others
    their configured weight. One rule for the admin API (decide/balance.py) and the CLI
    (cli/models.py)."""
    if action == "promote":
        return {n: (1.0 if n in canaries else 0.0) for n in configured}
    return {n: (0.0 if n in canaries else w) for n, w in configured.items()}


def read_weights(conn: sqlite3.Connection) -> dict[str, dict[str, dict[str, Any]]]:
    """alias -> deployment name -> {weight, updated_at, reason}."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for row in conn.execute(
        "SELECT alias, deployment, weight, updated_at, reason FROM deployment_weights"
    ):
        out.setdefault(row[0], {})[row[1]] = {
            "weight": float(row[2]),
            "updated_at": float(row[3]),
            "reason": row[4],
        }
    return out


def write_weights(
    conn: sqlite3.Connection, alias: str, weights: Mapping[str, float], reason: str
) -> None:
    """Set the weights of `alias`'s deployments (by their short names), in one
    transaction."""
    now = time.time()
    conn.execute("BEGIN IMMEDIATE")
    try:
        for name, w in weights.items():
            conn.execute(
                "INSERT INTO deployment_weights (alias, deployment, weight, updated_at, reason)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (alias, deployment) DO UPDATE SET"
                " weight = excluded.weight, updated_at = excluded.updated_at,"
                " reason = excluded.reason",
                (alias, name, float(w), now, reason[:500]),
            )
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def cut_weight(conn: sqlite3.Connection, alias: str, name: str, reason: str) -> bool:
    """Store weight 0 for `alias`'s deployment `name` unless it is 0 already; True when
    this call cut it. Every gateway process sharing a canary guard may find the same
    breach (at its own next outcome or exchange) before it reads the stored weight: only
    the one whose write changed the row reports the cut, so a host with N workers logs
    and counts it once, as one process would."""
    cur = conn.execute(
        "INSERT INTO deployment_weights (alias, deployment, weight, updated_at, reason)"
        " VALUES (?, ?, 0.0, ?, ?) ON CONFLICT (alias, deployment) DO UPDATE SET"
        " weight = excluded.weight, updated_at = excluded.updated_at,"
        " reason = excluded.reason WHERE deployment_weights.weight <> 0",
        (alias, name, time.time(), reason[:500]),
    )
    changed = cur.rowcount > 0
    conn.commit()
    return changed

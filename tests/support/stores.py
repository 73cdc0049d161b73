"""Store contents the retention tests put over their byte budget."""

from __future__ import annotations

from typing import Any


def fill_store(conn: Any, n: int, filler: str, first_at: float = 1_800_000_000.0) -> None:
    """`n` traces, `n` rollout records and `n` usage rows of ~1.5 KB (`filler` in their
    upstream column or record), one a second from `first_at`, and one daily rollup: a
    store to put over its byte budget."""
    import json

    from switchyard.state.traces import insert_sql

    conn.execute("BEGIN")
    for i in range(n):
        at = first_at + i
        rec = {"request_id": f"r{i}", "task_id": None, "tenant_id": "t", "status": "ok",
               "received_at": at, "pad": filler}  # fmt: skip
        conn.execute(insert_sql(), (f"r{i}", None, None, "t", "ok", at, json.dumps(rec)))
        conn.execute(
            "INSERT INTO usage (request_id, tenant_id, endpoint, status, received_at, upstream)"
            " VALUES (?, 't', 'chat', 'ok', ?, ?)",
            (f"r{i}", at, filler),
        )
        conn.execute(
            "INSERT INTO rollouts (sample_id, request_id, model, revision, created_at, record)"
            " VALUES (?, ?, 'm', 'r', ?, ?)",
            (f"s{i}", f"r{i}", at, filler),
        )
    conn.execute(
        "INSERT INTO usage_daily (day, tenant_id, requests, cost_usd)"
        " VALUES ('2027-01-15', 't', ?, 9.5)",
        (n,),
    )
    conn.execute("COMMIT")

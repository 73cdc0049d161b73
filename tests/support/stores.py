"""Store contents the tests write: what the retention tests put over their byte
budget, and a settled request's ledger entry (`ledger_entry`)."""

from __future__ import annotations

from typing import Any

from switchyard.state.traces import LedgerEntry

AT = 1_700_000_000.5


def ledger_entry(**fields: Any) -> LedgerEntry:
    """A served chat request's ledger entry (10 tokens in, 5 out, $0.25, one `select`
    decision), `fields` replaced."""
    at = fields.pop("received_at", AT)
    base: dict[str, Any] = {
        "request_id": "r1",
        "client_request_id": None,
        "task_id": None,
        "parent_request_ids": (),
        "tenant_id": "t1",
        "key_id": "k1",
        "endpoint": "chat.completions",
        "model": "m",
        "requested_model": "m",
        "revision": None,
        "upstream": "u",
        "status": "ok",
        "error_code": None,
        "attempts": 1,
        "input_tokens": 10,
        "output_tokens": 5,
        "cost_usd": 0.25,
        "cache": None,
        "fallback_from": None,
        "planned_steps": None,
        "stream": False,
        "received_at": at,
        "queue_ms": None,
        "t_received": 0.0,
        "t_upstream_sent": None,
        "t_upstream_first_byte": None,
        "t_client_first_byte": 0.01,
        "t_ended": 0.02,
        "clock_base": at,
        "decisions": [["select", "deployment:m", "why", None, 0.0, 0.001]],
    }
    return LedgerEntry(**(base | fields))


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

"""The state layer: every store behind a small interface, implementations side by side.

Named by concern, then implementation: `limits.py` (the interface and its types),
`limits_memory.py`, `limits_redis.py`; `tasks*.py`; `breakers*.py`; the SQL stores
(`keys`, `approvals`, `idempotency`, `tool_calls`, `responses`, `weights`, the ledger
and traces) run the same code on SQLite and PostgreSQL through one translating
connection (`sql.py`, `sql_pg.py`). `choose.py` picks the implementations from settings.
Nothing here imports the stages (policy, decide, execute, media) or observe.
"""

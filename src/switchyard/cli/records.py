"""What the gateway recorded, read from its store: `switchyard trace` (decision traces
of requests and agent tasks), `cost` (build vs buy) and `rollouts export`."""

from __future__ import annotations

import argparse
import json
import sys

from switchyard.cli._options import add_store_options
from switchyard.config import load_settings, store_target


def cmd_trace(args: argparse.Namespace) -> int:
    """trace show <request-or-task-id> | trace list: read the traces the gateway stored."""
    from switchyard.observe.render import render_request, render_task
    from switchyard.observe.tasks import analyze_task
    from switchyard.state.sql import connect
    from switchyard.state.sql_pg import redact
    from switchyard.state.traces import AmbiguousRequestId, get_request, get_task, list_requests

    path = store_target(load_settings(args.config), args.db)
    conn = connect(path)
    try:
        if args.action == "list":
            rows = list_requests(conn, args.tenant, None, args.status, args.limit)
            if args.json:
                print(json.dumps(rows, indent=2))
                return 0
            for r in rows:
                t = r.get("timings") or {}
                print(
                    f"{r['request_id']:<40} {r.get('task_id') or '-':<20} {r.get('model') or '-':<20} "
                    f"{r['status']:<10} {t.get('duration_ms') or 0:>9.1f} ms"
                )
            return 0
        try:
            record = get_request(conn, args.id, args.tenant)
        except AmbiguousRequestId as exc:
            print(f"switchyard: {exc} with --tenant", file=sys.stderr)
            return 2
        if record is not None:
            print(json.dumps(record, indent=2) if args.json else render_request(record))
            return 0
        try:
            records = get_task(conn, args.id, args.tenant)
        except AmbiguousRequestId as exc:
            print(f"switchyard: {exc} with --tenant", file=sys.stderr)
            return 2
        if records:
            analysis = analyze_task(records)
            if args.json:
                print(json.dumps({"task": analysis, "requests": records}, indent=2))
            else:
                print(render_task(analysis, records))
            return 0
        print(f"switchyard: no request or task '{args.id}' in {redact(path)}", file=sys.stderr)
        return 1
    finally:
        conn.close()


def cmd_cost(args: argparse.Namespace) -> int:
    """cost --since 30d: build vs buy from the usage ledger (observe/cost.py)."""
    import time

    from switchyard.observe.cost import cost_report, parse_since, render
    from switchyard.state.sql import connect

    settings = load_settings(args.config)
    now = time.time()
    try:
        since = parse_since(args.since, now)
    except ValueError as exc:
        print(f"switchyard: {exc}", file=sys.stderr)
        return 2
    conn = connect(store_target(settings, args.db))
    try:
        report = cost_report(conn, settings.cost, since, now)
    except ValueError as exc:
        print(f"switchyard: {exc}", file=sys.stderr)
        return 2
    finally:
        conn.close()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def cmd_rollouts(args: argparse.Namespace) -> int:
    """rollouts export --since 1d --format jsonl: stored rollout records for a trainer."""
    import time

    from switchyard.observe.cost import parse_since
    from switchyard.observe.rollouts import export_rollouts
    from switchyard.state.sql import connect

    settings = load_settings(args.config)
    try:
        since = parse_since(args.since, time.time())
    except ValueError as exc:
        print(f"switchyard: {exc}", file=sys.stderr)
        return 2
    conn = connect(store_target(settings, args.db))
    out = open(args.out, "w") if args.out else sys.stdout  # noqa: SIM115
    n = 0
    try:
        for rec in export_rollouts(conn, since, args.model, args.revision, args.tenant):
            out.write(json.dumps(rec, separators=(",", ":")) + "\n")
            n += 1
    finally:
        conn.close()
        if args.out:
            out.close()
    print(f"{n} records", file=sys.stderr)
    return 0


def add_trace(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tr = sub.add_parser("trace", help="show decision traces of requests and agent tasks")
    trsub = tr.add_subparsers(dest="action", required=True)
    trs = trsub.add_parser(
        "show", help="a request id (the gateway's, or the client's own) or a task id"
    )
    trs.add_argument("id")
    trs.add_argument("--tenant", help="the tenant, for a client's own request id")
    trl = trsub.add_parser("list", help="recent requests")
    trl.add_argument("--tenant")
    trl.add_argument("--status")
    trl.add_argument("--limit", type=int, default=50)
    for p in (trs, trl):
        add_store_options(p)
        p.add_argument("--json", action="store_true", help="raw JSON instead of text")
        p.set_defaults(func=cmd_trace)


def add_cost(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    co = sub.add_parser(
        "cost",
        help="build vs buy: local engines' traffic self-hosted vs on a managed API (config: cost)",
    )
    co.add_argument("--since", default="30d", help="30d, 12h, a date (UTC) or unix seconds")
    add_store_options(co)
    co.add_argument("--json", action="store_true", help="the report as JSON")
    co.set_defaults(func=cmd_cost)


def add_rollouts(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ro = sub.add_parser("rollouts", help="RL rollout records kept by the gateway")
    rosub = ro.add_subparsers(dest="action", required=True)
    rex = rosub.add_parser("export", help="stored records as JSON lines, oldest first")
    rex.add_argument("--since", default="30d", help="e.g. 2h, 7d, or a unix time")
    rex.add_argument("--format", choices=["jsonl"], default="jsonl")
    rex.add_argument("--model")
    rex.add_argument("--revision")
    rex.add_argument("--tenant")
    rex.add_argument("--out", help="a file (default: standard output)")
    rex.add_argument("--config")
    rex.add_argument("--db", help="the store (a SQLite path or a postgresql:// DSN)")
    rex.set_defaults(func=cmd_rollouts)

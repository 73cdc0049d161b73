"""`switchyard approve TASK CALL_ID`: approve one tool call's result, as
POST /admin/approvals does."""

from __future__ import annotations

import argparse
import json
import sys

from switchyard.cli._options import add_store_options
from switchyard.config import load_settings, store_target


def cmd_approve(args: argparse.Namespace) -> int:
    """approve TASK CALL_ID: the same ApprovalStore call as POST /admin/approvals,
    on the SQLite file the gateway with this config uses."""
    from switchyard.errors import SwitchyardError
    from switchyard.state.approvals import ApprovalStore
    from switchyard.state.sql import connect

    settings = load_settings(getattr(args, "config", None))
    store = ApprovalStore(connect(store_target(settings, args.db)))
    try:
        out = store.issue(
            args.tenant,
            None if args.task == "-" else args.task,
            args.call_id,
            args.approver,
            args.ttl_s if args.ttl_s is not None else settings.tools.approval_ttl_s,
        )
    except SwitchyardError as exc:
        print(f"switchyard: {exc.message}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2))
    print("\nGive the client this token now: it is shown only once.", file=sys.stderr)
    return 0


def add_approve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ap_ = sub.add_parser(
        "approve",
        help="approve one tool call's result (a tool that requires_approval); prints a "
        "single-use token for the client's x-switchyard-approval header",
    )
    ap_.add_argument("task", help="the task id (x-task-id); '-' for a call outside any task")
    ap_.add_argument("call_id", help="the tool call's id, as the reply gave it")
    ap_.add_argument("--tenant", required=True)
    ap_.add_argument("--approver", required=True, help="who approves (recorded in the trace)")
    ap_.add_argument("--ttl-s", type=float, help="lifetime (default tools.approval_ttl_s)")
    add_store_options(ap_)
    ap_.set_defaults(func=cmd_approve)

"""`switchyard tenants ...` and `switchyard keys ...`: the KeyStore calls the admin API
makes, on the store the gateway with this config uses (no running gateway needed)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from switchyard.cli._options import add_store_options
from switchyard.config import load_settings, store_target


def _store(args: argparse.Namespace) -> Any:
    """The key store the gateway with this config uses (same SQLite file)."""
    from switchyard.identity import Limits
    from switchyard.state.keys import KeyStore
    from switchyard.state.sql import connect

    settings = load_settings(getattr(args, "config", None))
    path = store_target(settings, args.db)
    d = settings.tenants_defaults
    return KeyStore(
        connect(path), Limits(d.rpm, d.tpm, d.max_concurrency, d.budget.usd, d.budget.period)
    )


def _limit_values(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in (
        "rpm",
        "tpm",
        "max_concurrency",
        "budget_usd",
        "budget_period",
        "name",
        "expires_in_s",
        "priority",
    ):
        v = getattr(args, name, None)
        if v is not None:
            out[name] = v
    if getattr(args, "models", None):
        out["allowed_models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    if getattr(args, "adapters", None):
        out["allowed_adapters"] = [m.strip() for m in args.adapters.split(",") if m.strip()]
    if getattr(args, "may_pin_revisions", False):
        out["may_pin_revisions"] = True
    if getattr(args, "may_report_device_state", False):
        out["may_report_device_state"] = True
    if getattr(args, "task_budget", None):
        from switchyard.policy.headers import task_budget

        out["task_budget"] = task_budget(args.task_budget)  # the header's syntax
    return out


def cmd_admin(args: argparse.Namespace) -> int:
    """keys/tenants subcommands: the same KeyStore calls the admin API makes."""
    from switchyard.errors import SwitchyardError

    try:
        store = _store(args)
        action = args.action
        if args.command == "tenants":
            if action == "create":
                out: Any = store.create_tenant(args.id, **_limit_values(args))
            elif action == "update":
                out = store.update_tenant(args.id, **_limit_values(args))
            elif action == "list":
                out = store.list_tenants()
            else:
                out = store.get_tenant(args.id)
        elif action == "create":
            out = store.create_key(args.tenant, **_limit_values(args))
        elif action == "update":
            out = store.update_key(args.id, **_limit_values(args))
        elif action == "list":
            out = store.list_keys(args.tenant)
        elif action == "revoke":
            out = store.revoke_key(args.id)
        else:
            out = store.get_key(args.id)
    except SwitchyardError as exc:
        print(f"switchyard: {exc.message}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2))
    if args.command == "keys" and action == "create":
        print("\nStore this key now: it is shown only once.", file=sys.stderr)
    return 0


def _add_limits(p: argparse.ArgumentParser) -> None:
    """The limits `create` sets and `update` changes (KeyStore.UPDATABLE's)."""
    p.add_argument("--rpm", type=int)
    p.add_argument("--tpm", type=int)
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--budget-usd", type=float)
    p.add_argument("--budget-period", choices=["day", "month"])


def _add_limit_options(p: argparse.ArgumentParser) -> None:
    _add_limits(p)
    p.add_argument("--models", help="comma-separated aliases or wildcards (default: all)")
    p.add_argument(
        "--task-budget",
        help="default budget of each agent task, e.g. 'calls=20, tokens=100000, cost_usd=1, "
        "wall_s=300' (a client's x-task-budget may only lower it)",
    )


def _add_priority_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--priority",
        choices=["interactive", "standard", "batch"],
        help="scheduling class under overload (default: standard; a key's only lowers its "
        "tenant's)",
    )


def _add_update_options(p: argparse.ArgumentParser) -> None:
    """What `tenants update` and `keys update` change (KeyStore.UPDATABLE)."""
    _add_limits(p)
    _add_priority_option(p)


def add_tenants(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tenants = sub.add_parser("tenants", help="manage tenants")
    tsub = tenants.add_subparsers(dest="action", required=True)
    tc = tsub.add_parser("create")
    tc.add_argument("id")
    _add_limit_options(tc)
    _add_priority_option(tc)
    tu = tsub.add_parser(
        "update",
        help="change a tenant's limits or priority (a gateway applies it within "
        "auth.key_cache_s; at once through the admin API)",
    )
    tu.add_argument("id")
    _add_update_options(tu)
    tl = tsub.add_parser("list")
    ts = tsub.add_parser("show")
    ts.add_argument("id")
    for p in (tc, tu, tl, ts):
        add_store_options(p)
        p.set_defaults(func=cmd_admin)


def add_keys(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser("keys", help="manage API keys")
    ksub = keys.add_subparsers(dest="action", required=True)
    kc = ksub.add_parser("create")
    kc.add_argument("--tenant", required=True)
    kc.add_argument("--name")
    kc.add_argument("--adapters", help="comma-separated adapter names or wildcards")
    kc.add_argument(
        "--may-pin-revisions",
        action="store_true",
        help='the key may name a revision: model "alias@revision"',
    )
    kc.add_argument(
        "--may-report-device-state",
        action="store_true",
        help="placement honours the key's x-switchyard-device-state and -network headers",
    )
    kc.add_argument("--expires-in-s", type=float)
    _add_limit_options(kc)
    _add_priority_option(kc)
    ku = ksub.add_parser("update", help="change a key's limits or priority")
    ku.add_argument("id")
    _add_update_options(ku)
    kl = ksub.add_parser("list")
    kl.add_argument("--tenant")
    kr = ksub.add_parser("revoke")
    kr.add_argument("id")
    ks = ksub.add_parser("show")
    ks.add_argument("id")
    for p in (kc, ku, kl, kr, ks):
        add_store_options(p)
        p.set_defaults(func=cmd_admin)

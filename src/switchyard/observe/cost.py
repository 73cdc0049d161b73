"""Build vs buy, from measured usage: what the traffic the local engines served cost
self-hosted, against what the same tokens cost on a managed API (`switchyard cost`,
GET /admin/cost, the console's cost page; one function for all three).

Both sides cover the same window, in the same unit. The window starts at the top of
the hour `since` falls in (engine busy time is kept per hour) and ends now; totals
are for that window and monthly figures are its hourly average times 730 hours, on
both sides, so a peak hour is never set against an average token price.

- Traffic: usage-ledger rows served by a local engine (their upstream is one, so cache
  hits and remote models are not in it), per model and tenant.
- Managed: those rows' tokens at `cost.managed` (or `cost.managed_models[model]`)
  prices per million input and output tokens.
- Self-hosted: `instances` * `instance_usd_per_hour` * hours + `ops_usd_per_month`
  pro rata. Utilization = engine busy seconds (at least one request held on the
  engine; recorded by the gateway per engine and hour) / (instances * window seconds).
- Break-even: the traffic (tokens/s at today's input/output mix) at which the managed
  bill equals the fixed self-hosted cost, and the utilization that traffic would need
  at the throughput measured while busy.
"""

from __future__ import annotations

import math
import re
import sqlite3
import time
from datetime import UTC, datetime
from typing import Any

from switchyard.config import CostConfig, Price

MONTH_H = 730.0  # hours in the month the monthly figures use (8760 / 12)
HOUR_S = 3600.0
# Upstream labels of rows served by a local engine (Deployment.label: "kind:url").
LOCAL_KINDS = ("llamacpp:", "vllm:")
_LOCAL_SQL = " OR ".join(f"upstream LIKE '{k}%'" for k in LOCAL_KINDS)
_SPAN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str, now: float) -> float:
    """Unix time from "30d" / "12h" / "90m" / "2w" (ago), an ISO date or time (UTC
    unless it says otherwise), or unix seconds."""
    text = text.strip()[:64]
    since = _since(text, now)
    if not 0.0 <= since <= now:  # NaN fails both: the report's hours are integers
        raise ValueError(
            f"cannot read {text!r} as a time between 1970 and now: use e.g. 30d, 12h, "
            "2026-11-01 or unix seconds"
        )
    return since


def _since(text: str, now: float) -> float:
    m = _SPAN.match(text)
    if m:
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"cannot read {text!r} as a time: use e.g. 30d, 12h, 2026-11-01 or unix seconds"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def record_busy(conn: sqlite3.Connection, engine: str, at: float, seconds: float) -> None:
    """Add `seconds` of busy time to `engine`'s hour that contains unix time `at`."""
    hour = int(at // HOUR_S)
    conn.execute(
        "INSERT INTO engine_busy (engine, hour, busy_s) VALUES (?, ?, ?)"
        " ON CONFLICT (engine, hour) DO UPDATE SET busy_s = engine_busy.busy_s + excluded.busy_s",
        (engine, hour, float(seconds)),
    )


def _price(cfg: CostConfig, model: str) -> Price:
    return cfg.managed_models.get(model, cfg.managed)


def _counts(prefix: str = "") -> dict[str, Any]:
    return {f"{prefix}requests": 0, f"{prefix}input_tokens": 0, f"{prefix}output_tokens": 0}


def _add(acc: dict[str, Any], n: int, inp: int, out: int, prefix: str = "") -> None:
    """Add one ledger group's requests and tokens to `acc`'s counts named `prefix`..."""
    acc[f"{prefix}requests"] += n
    acc[f"{prefix}input_tokens"] += inp
    acc[f"{prefix}output_tokens"] += out


def _usd(price: Price, inp: int, out: int) -> float:
    return (inp * price.input + out * price.output) / 1e6


def _round(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(x, nd)


def cost_report(
    conn: sqlite3.Connection, cfg: CostConfig, since: float, now: float | None = None
) -> dict[str, Any]:
    now = time.time() if now is None else now
    start = math.floor(since / HOUR_S) * HOUR_S
    if start >= now:
        raise ValueError("the report's window must start in the past")
    window_s = now - start
    hours = window_s / HOUR_S

    rows = conn.execute(
        "SELECT model, tenant_id, "
        f"CASE WHEN {_LOCAL_SQL} THEN 1 ELSE 0 END AS local, "
        "COUNT(*), SUM(input_tokens), SUM(output_tokens), SUM(cost_usd) "
        "FROM usage WHERE received_at >= ? AND received_at < ? "
        "GROUP BY model, tenant_id, local",
        (start, now),
    ).fetchall()
    models: dict[str, dict[str, Any]] = {}
    tenants: dict[str, dict[str, Any]] = {}
    for model, tenant, local, n, inp, out, billed in rows:
        model, tenant = model or "", tenant or ""
        inp, out, n = int(inp or 0), int(out or 0), int(n)
        m = models.setdefault(
            model,
            {
                "model": model,
                **_counts(),
                "billed_usd": 0.0,
                **_counts("self_hosted_"),
                "managed_usd": 0.0,
            },
        )
        _add(m, n, inp, out)
        m["billed_usd"] += float(billed or 0.0)
        if not local:
            continue
        managed = _usd(_price(cfg, model), inp, out)
        _add(m, n, inp, out, "self_hosted_")
        m["managed_usd"] += managed
        t = tenants.setdefault(tenant, {"tenant": tenant, **_counts(), "managed_usd": 0.0})
        _add(t, n, inp, out)
        t["managed_usd"] += managed

    busy_rows = conn.execute(
        "SELECT engine, SUM(busy_s) FROM engine_busy WHERE hour >= ? AND hour <= ? "
        "GROUP BY engine ORDER BY engine",
        (int(start // HOUR_S), int(now // HOUR_S)),
    ).fetchall()
    engines = [
        {"engine": e, "busy_s": _round(float(b or 0.0), 3), "utilization": _round(b / window_s)}
        for e, b in busy_rows
    ]
    busy_s = sum(float(b or 0.0) for _, b in busy_rows)

    req = sum(m["self_hosted_requests"] for m in models.values())
    inp = sum(m["self_hosted_input_tokens"] for m in models.values())
    out = sum(m["self_hosted_output_tokens"] for m in models.values())
    tokens = inp + out
    managed_total = sum(m["managed_usd"] for m in models.values())

    fixed_per_h = cfg.instances * cfg.instance_usd_per_hour + cfg.ops_usd_per_month / MONTH_H
    instance_usd = cfg.instances * cfg.instance_usd_per_hour * hours
    ops_usd = cfg.ops_usd_per_month * hours / MONTH_H
    self_total = instance_usd + ops_usd
    utilization = busy_s / (cfg.instances * window_s)

    usd_per_token = managed_total / tokens if tokens else None
    tokens_per_s = tokens / window_s
    # Throughput while busy, so what one instance could serve at 100 % utilization.
    per_instance_tps = tokens / busy_s if busy_s > 0 and tokens else None
    capacity_tps = per_instance_tps * cfg.instances if per_instance_tps is not None else None
    tokens_per_request = tokens / req if req else None

    break_even: dict[str, Any] = {
        "tokens_per_s": None,
        "requests_per_day": None,
        "utilization": None,
        "wins_at_full_utilization": None,
    }
    if usd_per_token:
        be_tps = fixed_per_h / HOUR_S / usd_per_token
        break_even["tokens_per_s"] = _round(be_tps)
        if tokens_per_request:
            break_even["requests_per_day"] = _round(be_tps / tokens_per_request * 86400, 3)
        if capacity_tps:
            break_even["utilization"] = _round(be_tps / capacity_tps)
        if per_instance_tps is not None:
            # One more instance pays for itself only if a full one beats the API.
            managed_full_h = per_instance_tps * HOUR_S * usd_per_token
            break_even["wins_at_full_utilization"] = managed_full_h > cfg.instance_usd_per_hour

    def per_month(total: float) -> float:
        return total / hours * MONTH_H

    report = {
        "window": {"since": start, "until": now, "hours": _round(hours)},
        "assumptions": {
            "month_hours": MONTH_H,
            "instances": cfg.instances,
            "instance_usd_per_hour": cfg.instance_usd_per_hour,
            "ops_usd_per_month": cfg.ops_usd_per_month,
            "managed_usd_per_mtok": {"input": cfg.managed.input, "output": cfg.managed.output},
            "managed_models": {k: v.model_dump() for k, v in cfg.managed_models.items()},
        },
        "models": [
            {k: _round(v) if isinstance(v, float) else v for k, v in m.items()}
            for m in sorted(models.values(), key=lambda m: m["model"])
        ],
        "tenants": [
            {k: _round(v) if isinstance(v, float) else v for k, v in t.items()}
            for t in sorted(tenants.values(), key=lambda t: t["tenant"])
        ],
        "engines": engines,
        "traffic": {
            "requests": req,
            "input_tokens": inp,
            "output_tokens": out,
            "tokens_per_s": _round(tokens_per_s),
            "requests_per_day": _round(req / window_s * 86400, 3),
        },
        "managed": {
            "total_usd": _round(managed_total),
            "per_month_usd": _round(per_month(managed_total)),
            "usd_per_mtok_blended": _round(usd_per_token * 1e6) if usd_per_token else None,
        },
        "self_hosted": {
            "instance_usd": _round(instance_usd),
            "ops_usd": _round(ops_usd),
            "total_usd": _round(self_total),
            "per_month_usd": _round(per_month(self_total)),
            "busy_s": _round(busy_s, 3),
            "utilization": _round(utilization),
            "idle_fraction": _round(max(0.0, 1.0 - utilization)),
            "tokens_per_busy_s": _round(per_instance_tps),
            "capacity_tokens_per_s": _round(capacity_tps),
        },
        "break_even": break_even,
        "curve": curve(cfg, usd_per_token, per_instance_tps, tokens_per_s, break_even),
    }
    report["verdict"] = verdict(report)
    return report


def self_hosted_per_month(cfg: CostConfig, tps: float, per_instance_tps: float | None) -> float:
    """Monthly self-hosted cost at `tps`: the configured instances, or as many as that
    traffic needs at the throughput measured while busy, plus operations."""
    n = cfg.instances
    if per_instance_tps:
        n = max(n, math.ceil(tps / per_instance_tps - 1e-9))
    return (n * cfg.instance_usd_per_hour) * MONTH_H + cfg.ops_usd_per_month


def curve(
    cfg: CostConfig,
    usd_per_token: float | None,
    per_instance_tps: float | None,
    today_tps: float,
    break_even: dict[str, Any],
    points: int = 24,
) -> dict[str, Any]:
    """Monthly cost against traffic (tokens/s) on both sides, today's point marked."""
    top = max(today_tps, break_even.get("tokens_per_s") or 0.0) * 2 or 1.0
    xs = [top * i / (points - 1) for i in range(points)]
    return {
        "unit": "USD per month against tokens/s (today's input/output mix)",
        "today_tokens_per_s": _round(today_tps),
        "points": [
            {
                "tokens_per_s": _round(x),
                "managed_usd_per_month": _round(x * HOUR_S * MONTH_H * usd_per_token)
                if usd_per_token is not None
                else None,
                "self_hosted_usd_per_month": _round(
                    self_hosted_per_month(cfg, x, per_instance_tps)
                ),
            }
            for x in xs
        ],
    }


def verdict(r: dict[str, Any]) -> str:
    m, s, be = r["managed"], r["self_hosted"], r["break_even"]
    if not r["traffic"]["requests"]:
        return "no traffic served by local engines in this window"
    if m["usd_per_mtok_blended"] is None:
        return "no managed prices configured (cost.managed): nothing to compare with"
    cheaper = "self-hosting" if s["total_usd"] < m["total_usd"] else "the managed API"
    out = (
        f"{cheaper} is cheaper for this window: self-hosted {s['per_month_usd']:.2f} vs "
        f"managed {m['per_month_usd']:.2f} USD/month at {r['traffic']['tokens_per_s']:.3f} "
        f"tokens/s and {s['utilization'] * 100:.1f} % utilization"
    )
    if be["tokens_per_s"] is not None:
        out += f"; break-even at {be['tokens_per_s']:.3f} tokens/s"
        if be["utilization"] is not None:
            out += f" ({be['utilization'] * 100:.1f} % utilization)"
    if be["wins_at_full_utilization"] is False:
        out += "; even a fully busy instance costs more than the managed API"
    return out


def render(r: dict[str, Any]) -> str:
    """The report as text, for the CLI."""
    w = r["window"]
    since = datetime.fromtimestamp(w["since"], UTC).strftime("%Y-%m-%d %H:%M")
    until = datetime.fromtimestamp(w["until"], UTC).strftime("%Y-%m-%d %H:%M")
    lines = [f"window: {since} to {until} UTC ({w['hours']:.2f} h)", ""]
    lines.append(f"{'model':<28}{'requests':>10}{'in tok':>12}{'out tok':>12}{'managed USD':>14}")
    for m in r["models"]:
        lines.append(
            f"{m['model'][:27]:<28}{m['self_hosted_requests']:>10}"
            f"{m['self_hosted_input_tokens']:>12}{m['self_hosted_output_tokens']:>12}"
            f"{m['managed_usd']:>14.4f}"
        )
    lines.append("")
    lines.append(f"{'tenant':<28}{'requests':>10}{'in tok':>12}{'out tok':>12}{'managed USD':>14}")
    for t in r["tenants"]:
        lines.append(
            f"{t['tenant'][:27]:<28}{t['requests']:>10}{t['input_tokens']:>12}"
            f"{t['output_tokens']:>12}{t['managed_usd']:>14.4f}"
        )
    s, m, be = r["self_hosted"], r["managed"], r["break_even"]
    lines += [
        "",
        "engines: "
        + (", ".join(f"{e['engine']} busy {e['busy_s']:.1f} s" for e in r["engines"]) or "none"),
        f"self-hosted: {s['total_usd']:.4f} USD ({s['per_month_usd']:.2f}/month), "
        f"utilization {s['utilization'] * 100:.2f} %, idle {s['idle_fraction'] * 100:.2f} %",
        f"managed API: {m['total_usd']:.4f} USD ({m['per_month_usd']:.2f}/month)",
        "break-even: "
        + (
            "n/a"
            if be["tokens_per_s"] is None
            else f"{be['tokens_per_s']:.4f} tokens/s"
            + (
                f", {be['requests_per_day']:.0f} requests/day"
                if be["requests_per_day"] is not None
                else ""
            )
            + (
                f", {be['utilization'] * 100:.2f} % utilization"
                if be["utilization"] is not None
                else ""
            )
        ),
        "",
        r["verdict"],
    ]
    return "\n".join(lines)

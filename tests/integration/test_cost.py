"""The build-vs-buy report (observe/cost.py): exact on a ledger with known rows, the
same through the CLI, and fed by real engine busy time from a running gateway."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support.gateways import local_model, start_gateway
from switchyard.config import CostConfig, Price
from switchyard.observe.cost import cost_report, parse_since, record_busy
from switchyard.state.sql import connect

H0 = 1_699_999_200.0  # the top of a UTC hour (472222 * 3600), in the past
NOW = H0 + 7200.0  # a two-hour window
CFG = CostConfig(
    instance_usd_per_hour=2.0,
    instances=2,
    ops_usd_per_month=730.0,  # 1 USD per hour
    managed=Price(input=1.0, output=4.0),
    managed_models={"big": Price(input=10.0, output=20.0)},
)


def known_ledger(path: str) -> None:
    conn = connect(path)
    rows = [
        # received_at, model, tenant, upstream, input, output
        (H0 + 10, "small", "a", "llamacpp:http://127.0.0.1:9001", 1_000_000, 500_000),
        (H0 + 3700, "small", "b", "vllm:http://127.0.0.1:9002", 2_000_000, 0),
        (H0 + 20, "big", "a", "llamacpp:http://127.0.0.1:9003", 100_000, 50_000),
        (H0 + 30, "small", "a", "http://remote.invalid/v1", 5_000_000, 5_000_000),  # remote
        (H0 + 40, "small", "a", None, 10, 10),  # a cache hit: no engine served it
        (H0 - 10, "small", "a", "llamacpp:http://127.0.0.1:9001", 9, 9),  # before the hour
        (NOW, "small", "a", "llamacpp:http://127.0.0.1:9001", 7, 7),  # not before now
    ]
    for i, (at, model, tenant, upstream, inp, out) in enumerate(rows):
        conn.execute(
            "INSERT INTO usage (request_id, tenant_id, endpoint, model, upstream,"
            " input_tokens, output_tokens, cost_usd, status, received_at)"
            " VALUES (?, ?, 'chat.completions', ?, ?, ?, ?, 0.5, 'ok', ?)",
            (f"r{i}", tenant, model, upstream, inp, out, at),
        )
    record_busy(conn, "small", H0 + 5, 1000.0)
    record_busy(conn, "small", H0 + 50, 800.0)  # adds to the same hour
    record_busy(conn, "small", H0 + 3601, 1800.0)
    record_busy(conn, "big", H0 + 100, 360.0)
    record_busy(conn, "small", H0 - 1, 999.0)  # the hour before the window
    conn.close()


def test_report_is_exact_on_known_rows(tmp_path: Path) -> None:
    db = str(tmp_path / "c.db")
    known_ledger(db)
    conn = connect(db)
    r = cost_report(conn, CFG, since=H0 + 100, now=NOW)  # since: floored to H0
    conn.close()
    assert r["window"] == {"since": H0, "until": NOW, "hours": 2.0}
    assert r["traffic"] == {
        "requests": 3,
        "input_tokens": 3_100_000,
        "output_tokens": 550_000,
        "tokens_per_s": round(3_650_000 / 7200, 6),
        "requests_per_day": 36.0,
    }
    small, big = r["models"][1], r["models"][0]
    assert (big["model"], big["self_hosted_requests"], big["managed_usd"]) == ("big", 1, 2.0)
    assert (small["requests"], small["self_hosted_requests"], small["managed_usd"]) == (4, 2, 5.0)
    assert small["billed_usd"] == 2.0  # what the gateway billed: 4 rows at 0.5
    assert r["tenants"] == [
        {
            "tenant": "a",
            "requests": 2,
            "input_tokens": 1_100_000,
            "output_tokens": 550_000,
            "managed_usd": 5.0,
        },
        {
            "tenant": "b",
            "requests": 1,
            "input_tokens": 2_000_000,
            "output_tokens": 0,
            "managed_usd": 2.0,
        },
    ]
    assert r["engines"] == [
        {"engine": "big", "busy_s": 360.0, "utilization": 0.05},
        {"engine": "small", "busy_s": 3600.0, "utilization": 0.5},
    ]
    assert r["managed"] == {
        "total_usd": 7.0,
        "per_month_usd": 2555.0,
        "usd_per_mtok_blended": round(7 / 3.65, 6),
    }
    s = r["self_hosted"]
    assert (s["instance_usd"], s["ops_usd"], s["total_usd"], s["per_month_usd"]) == (
        8.0,
        2.0,
        10.0,
        3650.0,
    )
    assert (s["busy_s"], s["utilization"], s["idle_fraction"]) == (3960.0, 0.275, 0.725)
    assert s["tokens_per_busy_s"] == round(3_650_000 / 3960, 6)
    be = r["break_even"]
    # 5 USD/h fixed over 7 USD per 3.65M tokens: tokens/s where the bills meet.
    assert be["tokens_per_s"] == round(5 * 3_650_000 / (3600 * 7), 6)
    assert be["utilization"] == round(5 * 3960 / (3600 * 7 * 2), 6)
    assert be["requests_per_day"] == round(5 * 3_650_000 / (3600 * 7) / (3_650_000 / 3) * 86400, 3)
    assert be["wins_at_full_utilization"] is True  # a busy instance is worth 6.36 USD/h
    assert r["verdict"].startswith("the managed API is cheaper for this window")
    pts = r["curve"]["points"]
    assert pts[0] == {
        "tokens_per_s": 0.0,
        "managed_usd_per_month": 0.0,
        "self_hosted_usd_per_month": 3650.0,
    }
    last = pts[-1]  # twice the break-even traffic: still within two instances' capacity
    assert last["tokens_per_s"] == round(2 * be["tokens_per_s"], 6)
    assert last["managed_usd_per_month"] == pytest.approx(2 * 5 * 730)
    assert last["self_hosted_usd_per_month"] == 3650.0


def test_more_traffic_than_the_instances_serve_needs_more_instances() -> None:
    from switchyard.observe.cost import self_hosted_per_month

    # 100 tokens/s per busy instance: 250 tokens/s needs 3 instances.
    assert self_hosted_per_month(CFG, 250.0, 100.0) == 3 * 2.0 * 730 + 730
    assert self_hosted_per_month(CFG, 200.0, 100.0) == 2 * 2.0 * 730 + 730
    assert self_hosted_per_month(CFG, 50.0, None) == 2 * 2.0 * 730 + 730


def test_no_prices_and_no_traffic_say_so(tmp_path: Path) -> None:
    db = str(tmp_path / "c.db")
    known_ledger(db)
    conn = connect(db)
    free = cost_report(conn, CostConfig(instance_usd_per_hour=1.0), since=H0, now=NOW)
    empty = cost_report(conn, CFG, since=H0 + 11_000, now=H0 + 12_000)  # from H0 + 3 h
    conn.close()
    assert free["break_even"]["tokens_per_s"] is None
    assert "no managed prices" in free["verdict"]
    assert empty["traffic"]["requests"] == 0
    assert empty["verdict"] == "no traffic served by local engines in this window"


@pytest.mark.parametrize(
    "text,expected",
    [
        ("30d", NOW - 30 * 86400),
        ("12h", NOW - 12 * 3600),
        ("90m", NOW - 5400),
        ("2w", NOW - 14 * 86400),
        (" 1.5d ", NOW - 1.5 * 86400),
        ("1700000000", 1_700_000_000.0),
        ("2023-11-14", None),
        ("2023-11-14T22:00:00+02:00", 1_699_992_000.0),
    ],
)
def test_since_forms(text: str, expected: float | None) -> None:
    if expected is None:  # an ISO date is midnight UTC
        import datetime as dt

        expected = dt.datetime(2023, 11, 14, tzinfo=dt.UTC).timestamp()
    assert parse_since(text, NOW) == expected


@pytest.mark.parametrize("bad", ["yesterday", "30 days", "-", "3x"])
def test_since_rejects_what_it_cannot_read(bad: str) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        parse_since(bad, NOW)


def test_cli_prints_the_same_report(tmp_path: Path) -> None:
    db = str(tmp_path / "c.db")
    known_ledger(db)
    args = [sys.executable, "-m", "switchyard", "cost", "--db", db, "--since", str(H0)]
    out = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    # The CLI's window ends now, so only the rows before now and their prices match.
    assert report["traffic"]["input_tokens"] == 3_100_000 + 7
    assert report["managed"]["total_usd"] == 0.0  # the default config has no prices
    text = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    assert "self-hosted:" in text.stdout and "break-even: n/a" in text.stdout
    bad = subprocess.run([*args[:-1], "whenever"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "cannot read 'whenever'" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_gateway_records_its_engines_busy_time() -> None:
    """Requests to the local engine are busy time in the store once the gateway stops
    (or every 10 s); the report counts them as self-hosted traffic."""
    config = {
        "models": [local_model()],
        "cost": {"instance_usd_per_hour": 1.0, "managed": {"input": 1.0, "output": 2.0}},
    }
    gw = start_gateway(config)
    t0 = time.time()
    try:
        for _ in range(3):
            r = gw.post(
                "/v1/chat/completions",
                json={
                    "model": "smollm2-135m",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": "Say hi"}],
                },
            )
            assert r.status_code == 200, r.text
        live = httpx.get(gw.url + "/admin/engines", headers=gw.admin).json()
        busy_now = live["engines"]["smollm2-135m"]["busy_s"]
        assert busy_now > 0
    finally:
        gw.proc.stop()
    wall = time.time() - t0
    out = subprocess.run(
        [sys.executable, "-m", "switchyard", "cost", "--db", gw.db, "--since", "1h", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    (engine,) = report["engines"]
    assert engine["engine"] == "smollm2-135m"
    assert busy_now <= engine["busy_s"] <= wall
    assert report["traffic"]["requests"] == 3
    (model,) = report["models"]
    assert model["self_hosted_requests"] == 3

"""A tenant's or key's `budget_usd` as the command line sets it (`switchyard tenants
create ... --budget-usd X`, `keys create/update`): the same KeyStore calls the admin
API makes (state/keys.py `_check_limits`), on a real SQLite store.

Defect this file finds (fails on the code before s73): the admin API can carry no NaN
or infinity (JSON has none) and refuses an integer past what SQLite stores
(api/admin/params.py), but the command line's `--budget-usd` is a Python float:
`nan` was stored (SQLite keeps a NaN as NULL: the default budget, silently), `inf`
was an unlimited budget that looks set, and 1e300 was taken as it came. Now each is
refused 400 `budget_usd` with one bound for every caller: a finite number from 0 to
the largest integer SQLite stores.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from switchyard.cli import main
from switchyard.errors import InvalidRequest
from switchyard.identity import Limits
from switchyard.state.keys import KeyStore
from switchyard.state.sql import connect

SQLITE_MAX = 2**63 - 1  # the largest integer SQLite stores
BAD = [-0.01, -1, math.nan, math.inf, -math.inf, 1e300, SQLITE_MAX + 1, float(2**64), True]


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "keys.db")


def _store(db: str) -> KeyStore:
    return KeyStore(connect(db), Limits())


@pytest.mark.parametrize("value", BAD, ids=repr)
def test_every_keystore_call_refuses_a_budget_out_of_bounds(db: str, value: object) -> None:
    store = _store(db)
    store.create_tenant("acme")
    key = store.create_key("acme")
    calls = [
        lambda: store.create_tenant("other", budget_usd=value),
        lambda: store.update_tenant("acme", budget_usd=value),
        lambda: store.create_key("acme", budget_usd=value),
        lambda: store.update_key(key["id"], budget_usd=value),
    ]
    for call in calls:
        with pytest.raises(InvalidRequest) as refused:
            call()
        assert refused.value.status == 400 and refused.value.param == "budget_usd"
        assert "budget_usd" in refused.value.message
    # Nothing was written: no tenant `other`, the old budgets unchanged (none: default).
    assert [t["id"] for t in store.list_tenants()] == ["acme"]
    assert store.get_tenant("acme")["limits"]["budget_usd"] is None
    assert [k["limits"]["budget_usd"] for k in store.list_keys("acme")] == [None]


@pytest.mark.parametrize("value", [0, 0.0, 12.5, 10**6, 10**15], ids=repr)
def test_a_budget_within_bounds_is_stored_as_given(db: str, value: float) -> None:
    store = _store(db)
    assert store.create_tenant("acme", budget_usd=value)["limits"]["budget_usd"] == value
    key = store.create_key("acme", budget_usd=value)
    assert store.get_key(key["id"])["limits"]["budget_usd"] == value
    assert store.update_key(key["id"], budget_usd=value)["limits"]["budget_usd"] == value


def test_the_bound_itself_is_taken(db: str) -> None:
    """The largest integer SQLite stores is a budget (kept as the column's REAL)."""
    got = _store(db).create_tenant("acme", budget_usd=SQLITE_MAX)["limits"]["budget_usd"]
    assert got == float(SQLITE_MAX)


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e300", "-5"])
def test_the_command_line_refuses_a_budget_out_of_bounds(
    db: str, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`switchyard tenants create` and `keys create` exit 1 naming budget_usd, and
    write nothing."""
    assert main(["tenants", "create", "acme", "--db", db]) == 0
    capsys.readouterr()
    argv = [
        ["tenants", "create", "other", f"--budget-usd={text}", "--db", db],
        ["tenants", "update", "acme", f"--budget-usd={text}", "--db", db],
        ["keys", "create", "--tenant", "acme", f"--budget-usd={text}", "--db", db],
    ]
    for args in argv:
        assert main(args) == 1, args
        err = capsys.readouterr().err
        assert "budget_usd" in err, err
    store = _store(db)
    assert [t["id"] for t in store.list_tenants()] == ["acme"]
    assert store.get_tenant("acme")["limits"]["budget_usd"] is None
    assert store.list_keys("acme") == []


def test_the_command_line_sets_a_budget_within_bounds(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tenants", "create", "acme", "--budget-usd", "25.5", "--db", db]) == 0
    capsys.readouterr()
    assert _store(db).get_tenant("acme")["limits"]["budget_usd"] == 25.5

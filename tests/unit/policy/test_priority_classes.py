"""Scheduling classes on tenants and keys (#48): stored, changed, and combined into the
principal's class, on a real SQLite file (the key store the CLI, the admin API and the
gateway share)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.errors import InvalidRequest
from switchyard.identity import PRIORITY_NAMES, STANDARD, Principal
from switchyard.state.keys import KeyStore
from switchyard.state.sql import connect

CLASSES = st.sampled_from([None, *PRIORITY_NAMES])


def _principal(store: KeyStore, key: str) -> Principal:
    got = store.verify(key)
    assert isinstance(got, Principal), got
    return got


@pytest.fixture
def store(tmp_path: Path) -> KeyStore:
    return KeyStore(connect(str(tmp_path / "gw.db")))


def test_a_tenant_is_standard_unless_given_a_class(store: KeyStore) -> None:
    assert store.create_tenant("plain")["priority"] == "standard"
    assert store.create_tenant("bulk", priority="batch")["priority"] == "batch"
    key = store.create_key("plain")
    assert key["priority"] is None  # its tenant's
    assert _principal(store, key["key"]).priority == STANDARD


@settings(max_examples=60, deadline=None)
@given(tenant=CLASSES, key=CLASSES, later=CLASSES)
def test_the_principal_gets_the_lower_of_its_tenants_and_its_keys_class(
    tmp_path_factory: pytest.TempPathFactory, tenant: str | None, key: str | None, later: str | None
) -> None:
    """A key's class only lowers its tenant's (a key cannot lift itself above its tenant),
    and a change to either is what the next verification sees."""
    store = KeyStore(connect(str(tmp_path_factory.mktemp("p") / "gw.db")))
    store.create_tenant("t", priority=tenant)
    made = store.create_key("t", priority=key)

    def rank(name: str | None) -> int:
        return PRIORITY_NAMES.index(name) if name else STANDARD

    assert _principal(store, made["key"]).priority == max(rank(tenant), rank(key))
    store.update_tenant("t", priority=later)
    assert _principal(store, made["key"]).priority == max(rank(later), rank(key))
    store.update_key(made["id"], priority=later)
    assert _principal(store, made["key"]).priority == rank(later)


def test_an_update_changes_only_what_it_names(store: KeyStore) -> None:
    store.create_tenant("t", rpm=10, tpm=1000, priority="interactive")
    out = store.update_tenant("t", rpm=20)
    assert out["limits"]["rpm"] == 20 and out["limits"]["tpm"] == 1000
    assert out["priority"] == "interactive"
    key = store.create_key("t", rpm=5)
    assert store.update_key(key["id"], priority="batch")["limits"]["rpm"] == 5


@pytest.mark.parametrize(
    ("values", "param"),
    [
        ({"priority": "urgent"}, "priority"),
        ({"priority": 0}, "priority"),
        ({"rpm": 0}, "rpm"),
        ({"allowed_models": ["*"]}, "allowed_models"),  # not changed by an update
        ({"id": "other"}, "id"),
    ],
)
def test_a_bad_update_is_refused_by_name_and_changes_nothing(
    store: KeyStore, values: dict[str, object], param: str
) -> None:
    store.create_tenant("t", rpm=10, priority="batch")
    with pytest.raises(InvalidRequest) as err:
        store.update_tenant("t", **values)
    assert err.value.param == param
    after = store.get_tenant("t")
    assert after["priority"] == "batch" and after["limits"]["rpm"] == 10


def test_an_empty_update_is_refused(store: KeyStore) -> None:
    store.create_tenant("t")
    with pytest.raises(InvalidRequest):
        store.update_tenant("t")


def test_a_database_made_before_classes_gains_them_as_standard(tmp_path: Path) -> None:
    path = str(tmp_path / "old.db")
    store = KeyStore(connect(path))
    store.create_tenant("t")
    key = store.create_key("t")
    old = sqlite3.connect(path)  # as a file from before the column shipped
    old.execute("ALTER TABLE tenants DROP COLUMN priority")
    old.execute("ALTER TABLE api_keys DROP COLUMN priority")
    old.commit()
    old.close()
    again = KeyStore(connect(path))
    assert again.get_tenant("t")["priority"] == "standard"
    assert _principal(again, key["key"]).priority == STANDARD

"""A tenant id is read whole wherever it is made (review s72 r1): the admin route
checked it with `fullmatch`, but the store beneath it (which the command line uses)
with `match`, whose `$` also takes a trailing newline."""

from __future__ import annotations

from pathlib import Path

import pytest

from switchyard.errors import InvalidRequest
from switchyard.state.keys import KeyStore
from switchyard.state.sql import connect


@pytest.fixture
def store(tmp_path: Path) -> KeyStore:
    return KeyStore(connect(str(tmp_path / "keys.db")))


@pytest.mark.parametrize("tenant_id", ["acme\n", "acme\r\n", "\nacme", "Acme", "", "a" * 64])
def test_a_tenant_id_that_is_not_whole_is_refused_by_the_store(
    store: KeyStore, tenant_id: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        store.create_tenant(tenant_id)
    assert refused.value.param == "id"
    assert store.conn.execute("SELECT COUNT(*) FROM tenants").fetchone()[0] == 0


def test_a_whole_tenant_id_is_made(store: KeyStore) -> None:
    made = store.create_tenant("acme-1")
    assert made["id"] == "acme-1"

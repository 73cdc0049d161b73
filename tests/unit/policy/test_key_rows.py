"""Tenant and key rows the admin API refuses to write (state/keys.py) but an older
release may have written: the key lookup never fails on them, and never reads one as
fewer restrictions than it meant. A key whose expiry is not a time has expired; a
tenant whose `regions` label is not a list of names is served in no region. And the
names of an approval (state/approvals.py), logged and shown in traces, are printable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from switchyard.errors import InvalidRequest
from switchyard.identity import Principal
from switchyard.state.approvals import ApprovalStore
from switchyard.state.keys import KeyStore
from switchyard.state.sql import connect


@pytest.fixture
def store(tmp_path: Path) -> KeyStore:
    return KeyStore(connect(str(tmp_path / "gw.db")))


@pytest.mark.parametrize("expires", ["tomorrow", "2026-12-01T00:00:00Z", b"\x01"])
def test_an_expiry_that_is_not_a_time_has_expired(store: KeyStore, expires: object) -> None:
    store.create_tenant("t")
    made = store.create_key("t")
    store.conn.execute("UPDATE api_keys SET expires_at = ? WHERE id = ?", (expires, made["id"]))
    assert store.verify(made["key"]) == "the API key has expired"


@pytest.mark.parametrize(
    ("labels", "regions"),
    [
        ({"regions": ["eu", "us"]}, ("eu", "us")),
        ({}, None),
        ({"regions": "eu"}, ()),
        ({"regions": {"eu": True}}, ()),
        ({"regions": ["eu", 5]}, ()),
        (["eu"], None),  # not an object: no `regions` in it, and no crash
    ],
)
def test_a_regions_label_is_read_as_a_boundary_or_as_none_allowed(
    store: KeyStore, labels: object, regions: tuple[str, ...] | None
) -> None:
    store.create_tenant("t")
    made = store.create_key("t")
    store.conn.execute("UPDATE tenants SET labels = ? WHERE id = 't'", (json.dumps(labels),))
    principal = store.verify(made["key"])
    assert isinstance(principal, Principal) and principal.regions == regions


def test_the_same_shapes_are_refused_when_written(store: KeyStore) -> None:
    for labels in ({"regions": "eu"}, ["eu"], {"tier": 5}, {"x" * 65: "y"}):
        with pytest.raises(InvalidRequest) as refused:
            store.create_tenant("t2", labels=labels)
        assert refused.value.param == "labels"
    store.create_tenant("t3")
    for expires in ("tomorrow", True, float("nan"), float("inf"), [1]):
        with pytest.raises(InvalidRequest) as refused:
            store.create_key("t3", expires_at=expires)
        assert refused.value.param == "expires_at"
    assert store.list_keys("t3") == []  # nothing written


def test_a_keys_name_is_kept_as_given_and_bounded(store: KeyStore) -> None:
    store.create_tenant("t")
    name = '<img src=x onerror="x">'
    assert store.create_key("t", name=name, may_report_device_state=True)["name"] == name
    with pytest.raises(InvalidRequest) as refused:
        store.create_key("t", name="n" * 129)
    assert refused.value.param == "name"


@pytest.mark.parametrize(
    "fields",
    [
        {"approver": "ops\nERROR forged log line"},
        {"approver": "ops\x1b[2J"},
        {"call_id": "call\r\nx"},
        {"tenant": "t\x00"},
    ],
)
def test_an_approval_is_issued_only_with_printable_names(
    tmp_path: Path, fields: dict[str, str]
) -> None:
    """The approver, call id and tenant of an approval are logged and shown in traces:
    a newline or a control sequence in one would forge lines there."""
    approvals = ApprovalStore(connect(str(tmp_path / "gw.db")))
    args = {"tenant": "t", "task_id": None, "call_id": "call_1", "approver": "ops", **fields}
    with pytest.raises(InvalidRequest) as refused:
        approvals.issue(**args, ttl_s=60)  # type: ignore[arg-type]
    assert refused.value.param == next(iter(fields))
    assert approvals.issue("t", None, "call_1", "ops — on call", 60)["approver"] == "ops — on call"


def test_a_tenants_regions_bound_where_its_requests_go() -> None:
    """The model's data boundary within the tenant's regions (the executor's rule), and
    whether a model running in some regions has one of them (what /v1/models lists)."""
    from switchyard.identity import Limits

    def who(regions: tuple[str, ...] | None) -> Principal:
        return Principal("t", "k", ("*",), ("*",), Limits(), Limits(), regions=regions)

    anywhere, eu = who(None), who(("eu", "eu-west"))
    assert anywhere.boundary(None) is None and anywhere.boundary(["us"]) == ["us"]
    assert eu.boundary(None) == ["eu", "eu-west"]
    assert eu.boundary(["eu-west", "us"]) == ["eu-west"]
    assert eu.reaches(None, ["us", "eu"]) and not eu.reaches(None, ["us"])
    assert not eu.reaches(["us"], ["eu"])  # the model may not go where the tenant may
    assert anywhere.reaches(None, ["us"]) and not anywhere.reaches(["eu"], ["us"])

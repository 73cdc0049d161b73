"""The one promote/rollback rule (state/weights.py) that the admin API's balancer and the
CLI both apply, and the canary cut that N processes report once."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from switchyard.state.sql import connect
from switchyard.state.weights import canary_weights, cut_weight, read_weights, write_weights

_NAMES = st.text("abcdef0123456789-", min_size=1, max_size=6)
_CONFIGURED = st.dictionaries(_NAMES, st.floats(0, 100, allow_nan=False), min_size=1, max_size=6)


@given(_CONFIGURED, st.data())
def test_promote_gives_the_canaries_everything_and_rollback_nothing(
    configured: dict[str, float], data: st.DataObject
) -> None:
    canaries = data.draw(st.sets(st.sampled_from(sorted(configured))))
    promoted = canary_weights("promote", configured, canaries)
    rolled = canary_weights("rollback", configured, canaries)
    assert promoted.keys() == rolled.keys() == configured.keys()
    for name, weight in configured.items():
        if name in canaries:
            assert (promoted[name], rolled[name]) == (1.0, 0.0)
        else:  # the others: none of the traffic after a promote, their own after a rollback
            assert (promoted[name], rolled[name]) == (0.0, weight)


def test_a_cut_is_reported_by_the_one_write_that_made_it(tmp_path: Path) -> None:
    """N workers finding one breach each store the cut; only the write that changed the
    row says so, and a canary given weight again is cut (and reported) anew."""
    conn = connect(str(tmp_path / "s.db"))
    others = [connect(str(tmp_path / "s.db")) for _ in range(3)]  # other workers' connections
    try:
        assert cut_weight(conn, "chat", "canary", "error rate 1.00") is True
        assert [cut_weight(c, "chat", "canary", "later") for c in others] == [False] * 3
        stored = read_weights(conn)["chat"]["canary"]
        assert (stored["weight"], stored["reason"]) == (0.0, "error rate 1.00")
        write_weights(conn, "chat", {"canary": 0.25}, "promoted again")
        assert cut_weight(others[0], "chat", "canary", "again") is True
        assert cut_weight(conn, "chat", "other", "first row") is True  # no row yet
    finally:
        for c in (conn, *others):
            c.close()

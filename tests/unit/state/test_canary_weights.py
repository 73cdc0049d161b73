"""The one promote/rollback rule (state/weights.py) that the admin API's balancer and the
CLI both apply."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from switchyard.state.weights import canary_weights

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

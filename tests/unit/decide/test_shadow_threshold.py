"""A partition's threshold moves as the shadow evidence says (decide/shadow_threshold.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from switchyard.config import ShadowFeedback
from switchyard.decide.shadow_threshold import PartitionThresholds

BASE = 0.90


def _t(**cfg: object) -> PartitionThresholds:
    return PartitionThresholds(ShadowFeedback.model_validate({"lower_after": 3, **cfg}))


def test_a_disagreeing_would_be_hit_raises_that_partition_only() -> None:
    t = _t()
    ev = t.observe("p1", BASE, 0.93, 0.35)
    assert ev["change"] == "raised"
    assert t.threshold("p1", BASE) == pytest.approx(0.94)
    assert t.threshold("p2", BASE) == BASE  # other partitions keep the configured one
    # A disagreement below the raised threshold changes nothing more.
    assert t.observe("p1", BASE, 0.91, 0.2)["change"] == "none"
    assert t.threshold("p1", BASE) == pytest.approx(0.94)


def test_the_raise_is_bounded() -> None:
    t = _t(max_raise=0.05)
    t.observe("p", BASE, 0.99, 0.1)
    assert t.threshold("p", BASE) == pytest.approx(0.95)


def test_agreements_in_a_row_lower_it_back_but_never_below_the_configured_one() -> None:
    t = _t()
    t.observe("p", BASE, 0.915, 0.2)  # raised to 0.925
    assert t.threshold("p", BASE) == pytest.approx(0.925)
    for _ in range(2):
        assert t.observe("p", BASE, 0.95, 0.97)["change"] == "none"
    assert t.observe("p", BASE, 0.95, 0.97)["change"] == "lowered"
    assert t.threshold("p", BASE) == pytest.approx(0.915)
    # An agreement below the current threshold is not evidence for it; nor does a
    # disagreement in between let the count carry on.
    t.observe("p", BASE, 0.95, 0.97)
    t.observe("p", BASE, 0.90, 0.2)  # below: already above, but resets the count
    t.observe("p", BASE, 0.95, 0.97)
    t.observe("p", BASE, 0.95, 0.97)
    assert t.threshold("p", BASE) == pytest.approx(0.915)
    for _ in range(30):
        t.observe("p", BASE, 0.99, 0.99)
    assert t.threshold("p", BASE) == pytest.approx(BASE)


def test_off_it_never_moves() -> None:
    t = _t(enabled=False)
    assert t.observe("p", BASE, 0.95, 0.1)["change"] == "none"
    assert t.threshold("p", BASE) == BASE


def test_partitions_are_bounded() -> None:
    t = PartitionThresholds(ShadowFeedback(), max_partitions=2)
    for p in ("a", "b", "c"):
        t.observe(p, BASE, 0.95, 0.1)
    assert t.raised("a") == 0.0 and t.raised("c") > 0


@given(
    st.lists(
        st.tuples(st.floats(0.5, 1.0), st.floats(-1.0, 1.0)),
        max_size=60,
    )
)
def test_the_threshold_stays_within_its_bounds(events: list[tuple[float, float]]) -> None:
    t = _t(max_raise=0.06)
    for prompt, answer in events:
        t.observe("p", BASE, prompt, answer)
        assert BASE - 1e-9 <= t.threshold("p", BASE) <= BASE + 0.06 + 1e-9

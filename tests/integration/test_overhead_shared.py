"""The learned prompt overhead shared between gateway processes through a real
redis-server (state/overhead_redis.py): what one process learned from a model's
replies, the others reserve with after one exchange; values only grow."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.policy.cost import PromptOverhead
from switchyard.state.overhead_redis import SharedOverhead


async def _exchange(share: SharedOverhead, overhead: PromptOverhead) -> None:
    for alias, (floor, ratio) in (await share.exchange(dict(overhead.learned))).items():
        overhead.merge(alias, floor, ratio)


def test_what_one_process_learned_the_others_reserve_with(redis_url: str) -> None:
    async def go() -> tuple[int, int, int]:
        prefix = f"t{uuid.uuid4().hex[:8]}:"
        a, b = PromptOverhead(64), PromptOverhead(64)
        sa, sb = SharedOverhead(redis_url, 1.0, prefix), SharedOverhead(redis_url, 1.0, prefix)
        before = b.get("m", 1000)
        a.observe("m", 1000, 1000 + 900)  # a template of 900 tokens, seen by `a` only
        await _exchange(sa, a)
        await _exchange(sb, b)
        after = b.get("m", 1000)
        await sa.close()
        await sb.close()
        return before, after, a.get("m", 1000)

    before, after, learned = asyncio.run(go())
    assert before == 64 and after == learned == 900


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 20_000)), max_size=6),
        min_size=1,
        max_size=4,
    )
)
def test_every_process_ends_with_the_largest_of_what_any_learned(
    redis_url: str, seen: list[list[tuple[int, int]]]
) -> None:
    """Whatever each process saw (prompt estimates and reported counts), after every
    process exchanged twice each holds, per part, the largest any of them learned."""

    async def go() -> tuple[list[dict[str, tuple[int, float]]], list[dict[str, tuple[int, float]]]]:
        prefix = f"t{uuid.uuid4().hex[:8]}:"
        procs = [PromptOverhead(64) for _ in seen]
        for p, counts in zip(procs, seen, strict=True):
            for base, reported in counts:
                p.observe("m", base, reported)
        alone = [dict(p.learned) for p in procs]
        shares = [SharedOverhead(redis_url, 1.0, prefix) for _ in procs]
        for _ in range(2):
            for p, s in zip(procs, shares, strict=True):
                await _exchange(s, p)
        for s in shares:
            await s.close()
        return alone, [dict(p.learned) for p in procs]

    alone, after = asyncio.run(go())
    learned = [x["m"] for x in alone if "m" in x]
    if not learned:
        assert all(x == {} for x in after)
        return
    expected = (max(f for f, _ in learned), max(r for _, r in learned))
    for x in after:
        assert x["m"][0] == expected[0]
        assert x["m"][1] == pytest.approx(expected[1], rel=1e-12)

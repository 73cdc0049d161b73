"""The Responses API's ids (api/responses_codec.py's IdPool): hex digits made a block
at a time from the entropy pool, 32 an id. Each id is the prefix and 128 random bits,
none handed out twice, and a child made by `fork` does not hand out the ids its parent
had made ready (it forgets them with the pool's bytes)."""

from __future__ import annotations

import os
import re
import time

from switchyard.api.responses import RECENT_MS, SETTLE_S, settle_s
from switchyard.api.responses_codec import IdPool

_ID = re.compile(r"(resp|msg|fc)_[0-9a-f]{32}")


def test_ids_are_the_prefix_and_128_bits_never_twice_across_blocks() -> None:
    pool = IdPool()
    made = [pool(("resp", "msg", "fc")[i % 3]) for i in range(1000)]  # 15 blocks and more
    assert all(_ID.fullmatch(i) for i in made)
    assert len({i.split("_", 1)[1] for i in made}) == len(made)


def test_a_forked_child_makes_none_of_the_ids_its_parent_makes() -> None:
    pool = IdPool()
    pool("resp")  # a block of digits made ready before the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        try:
            os.write(write, " ".join(pool("msg") for _ in range(8)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as got:
        child = {i.split("_", 1)[1] for i in got.read().split()}
    os.waitpid(pid, 0)
    parent = {pool("msg").split("_", 1)[1] for _ in range(8)}
    assert len(child) == 8 and not child & parent


def test_timed_ids_are_the_millisecond_then_80_bits_never_twice() -> None:
    pool = IdPool()
    before = int(time.time() * 1000)
    made = [pool.timed("resp") if i % 2 else pool("msg") for i in range(2000)]  # blocks mixed
    after = int(time.time() * 1000)
    timed = [i for i in made if i.startswith("resp_")]
    assert all(_ID.fullmatch(i) for i in made)
    assert len({i.split("_", 1)[1] for i in made}) == len(made)
    stamps = [int(i[5:17], 16) for i in timed]
    assert all(before <= s <= after for s in stamps)
    assert stamps == sorted(stamps)  # made in order: they sort in time
    # the 80 random bits: none repeats, and they are not the time's digits
    tails = [i[17:] for i in timed]
    assert len(set(tails)) == len(tails) and all(len(t) == 20 for t in tails)


def test_only_a_recent_id_is_waited_for() -> None:
    """A lookup that misses waits for another gateway's commit only for an id made in
    the last RECENT_MS (its time is in it): a made-up, old or foreign id costs one read."""
    now = int(time.time() * 1000)
    pool = IdPool()
    assert settle_s(pool.timed("resp"), now) == SETTLE_S
    assert settle_s(f"resp_{now - RECENT_MS - 1:012x}" + "0" * 20, now) == 0.0
    assert settle_s(f"resp_{now + 60_000:012x}" + "0" * 20, now) == 0.0  # ahead of every clock
    assert settle_s("resp_" + "0" * 32, now) == 0.0
    assert settle_s("resp_" + "f" * 32, now) == 0.0
    assert settle_s("resp_zz", now) == 0.0
    assert settle_s(pool("resp"), now) == 0.0  # 128 random bits (an id made before times)

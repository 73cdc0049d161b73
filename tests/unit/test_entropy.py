"""The pool of random bytes (entropy.py): every slice once, in this process, across
threads and in a child made by fork (an AES-GCM nonce twice under one key would give
the key's authentication away)."""

from __future__ import annotations

import os
import threading

from switchyard.entropy import RandomPool


def test_slices_are_never_handed_out_twice_across_blocks_and_threads() -> None:
    pool = RandomPool(block=64)  # a refill every few takes
    got: list[bytes] = []

    def take() -> None:
        mine = [pool.take(12) for _ in range(2000)]
        got.extend(mine)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8000 and all(len(b) == 12 for b in got)
    assert len(set(got)) == len(got)


def test_a_forked_child_draws_bytes_the_parent_does_not() -> None:
    pool = RandomPool()
    pool.take(12)  # the parent's pool holds the rest of its block
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next slices, down the pipe
        try:
            os.write(write, b"".join(pool.take(12) for _ in range(8)))
        finally:
            os._exit(0)
    os.close(write)
    child = b""
    while chunk := os.read(read, 4096):
        child += chunk
    os.close(read)
    os.waitpid(pid, 0)
    parent = b"".join(pool.take(12) for _ in range(8))
    assert len(child) == len(parent) == 96
    assert {child[i : i + 12] for i in range(0, 96, 12)}.isdisjoint(
        {parent[i : i + 12] for i in range(0, 96, 12)}
    )

"""CPU per request in `bench overhead`: a process tree's CPU read from /proc
(bench/harness.py `cpu_sample`), on real processes that burn known amounts."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from switchyard.bench.harness import cpu_sample
from switchyard.bench.harness_machine import process_role
from switchyard.bench.overhead import _cpu

# Burns `s` seconds of CPU in itself and as much again in a child it waits for; then
# sleeps so the sample can be taken while it is alive.
BURN = """
import subprocess, sys, time
def burn(s):
    end = time.process_time() + s
    while time.process_time() < end:
        pass
s = float(sys.argv[1])
child = subprocess.Popen([sys.executable, "-c", f"import time\\nend=time.process_time()+{s}\\nwhile time.process_time()<end: pass\\ntime.sleep(30)"])
burn(s)
print("burnt", flush=True)
time.sleep(30)
"""


def test_a_process_trees_cpu_counts_its_children_and_nothing_else() -> None:
    tree = subprocess.Popen([sys.executable, "-c", BURN, "0.4"], stdout=subprocess.PIPE)
    other = subprocess.Popen([sys.executable, "-c", BURN, "0.4"], stdout=subprocess.PIPE)
    try:
        before = cpu_sample([tree.pid])
        assert tree.stdout is not None and other.stdout is not None
        assert tree.stdout.readline() == b"burnt\n"
        assert other.stdout.readline() == b"burnt\n"
        time.sleep(1.0)  # the child finishes its own 0.4 s too
        after = cpu_sample([tree.pid])
    finally:
        for p in (tree, other):
            p.kill()
            p.wait()
    used = after.trees[tree.pid] - before.trees[tree.pid]
    # 0.4 s in the parent and 0.4 s in its child, plus interpreter start-up; the other
    # tree's 0.8 s is not in it.
    assert 0.75 <= used <= 1.6, used
    # The same split by process: the root (the gateway's place) and its child, named
    # by its executable; the parts add up to the tree.
    split = after.parts[tree.pid]
    assert set(split) == {"gateway", after_child_name(split)}
    assert sum(split.values()) == pytest.approx(after.trees[tree.pid])
    for role, seconds in split.items():
        assert 0.35 <= seconds - before.parts[tree.pid].get(role, 0.0) <= 0.9, (role, split)


def after_child_name(split: dict[str, float]) -> str:
    (child,) = set(split) - {"gateway"}
    assert child.startswith("python"), split  # its executable's name, from /proc
    return child


@pytest.mark.parametrize(
    ("cmdline", "comm", "root", "has_workers", "role"),
    [
        (b"python\0-m\0switchyard\0serve", "python3", True, False, "gateway"),
        (b"python\0-m\0switchyard\0serve", "python3", True, True, "control plane"),
        (b"python\0-m\0switchyard.scale.worker", "python3", False, True, "workers"),
        (b"python\0-m\0switchyard.observe.ledger_writer", "python3", False, False, "ledger writer"),
        (b"redis-server\0/tmp/x.conf", "redis-server", False, True, "redis-server"),
    ],
)
def test_each_process_of_a_gateway_is_named_by_its_role(
    cmdline: bytes, comm: str, root: bool, has_workers: bool, role: str
) -> None:
    assert process_role(cmdline, comm, root, has_workers) == role


def test_the_load_generators_cpu_is_what_its_waited_run_used() -> None:
    before = cpu_sample([])
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    after = cpu_sample([])
    assert 0.28 <= after.waited - before.waited <= 1.0
    row = _cpu(before, after, None, None, 1000, 1.0, 2)
    assert row["cpu_us_per_req"] is None and row["upstream_cpu_us_per_req"] is None
    assert 0.14 <= row["loader_cpu_share"] <= 0.5  # 0.3 s of 2 cores' 1 s

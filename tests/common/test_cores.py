"""A process's threads are seen waiting for a core when another process runs on it, and told once what to do."""

from __future__ import annotations

import subprocess
import sys

import pytest
from structlog.testing import capture_logs

from rlbus.common import cores
from tests.conftest import REPO

# Pinned to one core (its own affinity, in a process of its own), it spins alone, then beside a spinning rival
# pinned to the same core: Linux then shares the core out between the two, and the spinning thread waits for it
# about half the time.
RIVAL = """
import os, subprocess, sys, time
from rlbus.common.cores import CoreWait

os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass

waits = CoreWait("test.threads", 1)
spin(0.3)
alone = waits.share()
rival = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # its affinity: this one's core
try:
    time.sleep(0.3)
    waits.share()
    spin(0.8)
    shared = waits.share()
finally:
    rival.kill()
    rival.wait()
print(alone, shared)
"""


def test_a_thread_sharing_its_core_with_a_busy_process_is_seen_waiting_for_it():
    if not cores.thread_times():
        pytest.skip("this kernel does not count threads' waits (no /proc/self/task/*/schedstat)")
    done = subprocess.run([sys.executable, "-c", RIVAL], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    alone, shared = map(float, done.stdout.split())
    assert 0 <= alone <= 1
    assert 0.3 < shared <= 1  # about 0.5: the rival has the core half the time


def _feed(monkeypatch, snapshots: list[dict[int, tuple[int, int]]], threads: int = 2) -> cores.CoreWait:
    """A CoreWait reading the given snapshots of {thread: (ns run, ns waited)}, the first at its start."""
    it = iter(snapshots)
    monkeypatch.setattr(cores, "thread_times", lambda: next(it))
    return cores.CoreWait("explorer.threads", threads)


def test_the_share_counts_each_threads_time_since_the_last_reading(monkeypatch):
    waits = _feed(monkeypatch, [
        {1: (100, 0), 2: (50, 50)},
        {1: (400, 100), 2: (50, 50), 3: (100, 0)},  # 1: ran 300, waited 100; 2: idle; 3 started since: 100 run
        {3: (200, 100)},  # 1 and 2 ended; 3: ran 100, waited 100
        {3: (200, 100)},  # nothing ran
    ])
    assert waits.share() == pytest.approx(100 / 500)
    assert waits.share() == pytest.approx(0.5)
    assert waits.share() is None


def _over_and_under(monkeypatch, readings: list[float], threads: int) -> tuple[cores.CoreWait, list[dict]]:
    snapshots, run, wait = [{1: (0, 0)}], 0, 0
    for share in readings:  # 1000 ns of each interval, `share` of it waiting
        run, wait = run + round(1000 * (1 - share)), wait + round(1000 * share)
        snapshots.append({1: (run, wait)})
    return _feed(monkeypatch, snapshots, threads)


def test_a_share_over_the_bound_twice_in_a_row_is_a_warning_once_naming_the_setting(monkeypatch):
    high = cores.WARN_SHARE + 0.1
    readings = [0.0, high, 0.0, high, high, high, high]
    waits = _over_and_under(monkeypatch, readings, threads=2)
    with capture_logs() as logs:
        said = []
        for share in readings:
            assert waits.measure() == pytest.approx(share, abs=1e-3)
            said.append(sum(e["event"] == "cores_shared" for e in logs))
    assert said == [0, 0, 0, 0, 1, 1, 1]  # once the bound is passed twice in a row, and only once
    warning = next(e for e in logs if e["event"] == "cores_shared")
    assert warning["log_level"] == "warning" and "explorer.threads" in warning["hint"] and warning["threads"] == 2


def test_a_single_thread_sharing_its_core_is_measured_without_a_warning(monkeypatch):
    """Nothing waits on a lone thread: sharing a core costs it that share, not many times over."""
    waits = _over_and_under(monkeypatch, [0.5] * 4, threads=1)
    with capture_logs() as logs:
        assert [waits.measure() for _ in range(4)] == [0.5] * 4
    assert not [e for e in logs if e["event"] == "cores_shared"]


def test_where_linux_does_not_count_waits_there_is_no_share(monkeypatch, tmp_path):
    monkeypatch.setattr(cores, "TASKS", tmp_path / "absent")
    assert cores.thread_times() == {}
    assert cores.CoreWait("trainer.threads", 2).measure() is None

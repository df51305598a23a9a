"""Admission control: which policy version may generate which explorer batch."""

from __future__ import annotations

import pytest

from rlbus.common import protocol as P
from rlbus.common.config import SyncConfig


@pytest.mark.parametrize("interval,offset,expected", [
    # I=4, O=0: batches 0-3 from version 0, 4-7 need version 4, ...
    (4, 0, [0, 0, 0, 0, 4, 4, 4, 4, 8]),
    # I=1, O=4: the explorer runs 4 batches ahead; batch 5 needs version 1.
    (1, 4, [0, 0, 0, 0, 0, 1, 2, 3, 4]),
    # one-step off-policy: batch e needs version e - 1.
    (1, 1, [0, 0, 1, 2, 3, 4, 5, 6, 7]),
    # synchronous: batch e needs version e.
    (1, 0, [0, 1, 2, 3, 4, 5, 6, 7, 8]),
])
def test_lockstep_formula(interval, offset, expected):
    sync = SyncConfig(sync_interval=interval, sync_offset=offset)
    assert [sync.required_version(e) for e in range(9)] == expected
    assert sync.max_staleness == offset + interval - 1


@pytest.mark.parametrize("interval,offset", [(4, 0), (1, 4), (1, 1)])
def test_broker_leases_exactly_the_batches_version_zero_may_generate(broker_factory, clients, interval, offset):
    """A version-0 explorer gets every task of the admitted batches, then WAIT naming the version it needs."""
    b = broker_factory(f"sync.sync_interval={interval}", f"sync.sync_offset={offset}", "data.batch_tasks=2")
    ex = clients(b, "explorer", "ex")
    sync = SyncConfig(sync_interval=interval, sync_offset=offset)
    allowed = sum(1 for e in range(50) if sync.required_version(e) == 0)
    got = ex.request(P.LEASE, {"max_tasks": 100, "policy_version": 0})
    assert got.command == P.TASKS
    batches = sorted({t["batch_index"] for t in got.header["tasks"]})
    assert batches == list(range(allowed))
    assert len(got.header["tasks"]) == 2 * allowed
    wait = ex.request(P.LEASE, {"max_tasks": 1, "policy_version": 0})
    assert wait.command == P.WAIT and wait.header["reason"] == "version"
    assert wait.header["need_version"] == sync.required_version(allowed)
    more = ex.request(P.LEASE, {"max_tasks": 2, "policy_version": wait.header["need_version"]})
    assert more.command == P.TASKS and more.header["tasks"][0]["batch_index"] == allowed


def test_async_explorer_too_far_behind_the_trainer_waits(broker_factory, clients):
    """In async style an explorer more than max_staleness versions behind the trainer's step gets WAIT."""
    b = broker_factory("sync.sync_style=async", "sync.max_staleness=1", "data.batch_tasks=1")
    ex = clients(b, "explorer", "ex")
    tr = clients(b, "trainer", "tr")
    for step in range(6):  # the trainer is at step 5 (steps advance one at a time)
        tr.request(P.FETCH, {"step": step, "max_groups": 1})
    wait = ex.request(P.LEASE, {"max_tasks": 1, "policy_version": 0})
    assert wait.command == P.WAIT and wait.header["need_version"] == 4
    assert ex.request(P.LEASE, {"max_tasks": 1, "policy_version": 4}).command == P.TASKS


def test_lockstep_needs_max_staleness_at_least_offset_plus_interval_minus_one():
    with pytest.raises(ValueError, match="max_staleness >= 4"):
        SyncConfig(sync_interval=1, sync_offset=4, max_staleness=2)

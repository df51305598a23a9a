"""Revisits (data.revisit): tasks the policy solves sometimes are issued again, from two batches on, and the
broker's catalogue keeps which seq holds which task across a restart."""

from __future__ import annotations

import pytest

from rlbus.broker.catalog import Catalog
from rlbus.broker.tasks import TaskQueue
from rlbus.common import protocol as P
from rlbus.common.tasksets import ArithTaskset
from tests.conftest import group

TASKSET = ArithTaskset(seed=0)


def queue(catalog: Catalog, revisit: float = 0.5, times: int = 1, size: int = 0) -> TaskQueue:
    return TaskQueue(catalog, ArithTaskset(seed=0, size=size), 4, 60.0, revisit, times)


def lease_batch(q: TaskQueue, n: int = 4) -> list[tuple[int, dict]]:
    return [(lease.seq, task) for lease, task in q.lease("ex", n, 0.0, lambda batch: True)]


def test_informative_tasks_come_again_two_batches_later_in_the_last_slots_and_survive_a_restart(tmp_path):
    catalog = Catalog(tmp_path / "c.sqlite3", fsync=False)
    q = queue(catalog)
    first = lease_batch(q)
    assert [task for _, task in first] == [TASKSET.task(i) for i in range(4)]
    for seq, _ in first:  # tasks 0 and 2 were solved sometimes, 1 and 3 always or never
        q.complete(f"t{seq}.0", informative=seq in (0, 2))
    second = lease_batch(q)  # batch 1: too soon for a revisit
    assert [task for _, task in second] == [TASKSET.task(i) for i in range(4, 8)]
    third = lease_batch(q)  # batch 2: its last two slots take the revisits, oldest first
    assert [task for _, task in third] == [TASKSET.task(8), TASKSET.task(9), TASKSET.task(0), TASKSET.task(2)]
    catalog.close()

    again = queue(Catalog(tmp_path / "c.sqlite3", fsync=False))  # the broker restarted: batch 2 still out
    assert again.revisited == q.revisited and [seq for seq, _ in third] == [8, 9, 10, 11]
    assert [again.task(seq)[0] for seq in range(12)] == [t for _, t in first + second + third]
    for seq, _ in second:
        again.complete(f"t{seq}.0", informative=False)
    again.complete("t10.0", informative=True)  # a revisit issued once already (revisit_times 1): not again
    again.complete("t8.0", informative=True)
    assert [t[1] for t in again.waiting] == [TASKSET.task(8)]
    # The next fresh task follows the last one issued, whatever came between.
    assert lease_batch(again, 1) == [(12, TASKSET.task(10))]


def test_a_lease_that_cannot_be_recorded_leaves_the_queue_as_it_was(tmp_path):
    """The catalogue refusing a lease's record (a full disk) undoes everything that lease took: a lapsed seq,
    fresh seqs, a waiting revisit and their attempt numbers. The next lease is the one it would have been."""
    import sqlite3

    def prepared(name: str) -> TaskQueue:
        q = queue(Catalog(tmp_path / name, fsync=False))
        first = lease_batch(q)
        for seq, _ in first[1:]:
            q.complete(f"t{seq}.0", informative=seq == 2)
        lease_batch(q)
        q.expire(float("inf"))  # the leases out (seqs 0, 4-7) lapse: the next lease takes them again first
        return q

    q, twin = prepared("q.sqlite3"), prepared("twin.sqlite3")
    state = lambda q: (q.next_seq, sorted(q.free), dict(q.attempts), dict(q.leases), list(q.waiting),  # noqa: E731
                       dict(q.revisited), list(q.revisit_seqs))
    before = state(q)

    def full(*_):
        raise sqlite3.OperationalError("database or disk is full")

    q.catalog.lease, real = full, q.catalog.lease
    with pytest.raises(sqlite3.OperationalError):
        q.lease("ex", 8, 0.0, lambda batch: True)
    assert state(q) == before
    q.catalog.lease = real
    got = q.lease("ex", 8, 0.0, lambda batch: True)
    want = twin.lease("ex", 8, 0.0, lambda batch: True)
    assert [(lz.lease_id, t) for lz, t in got] == [(lz.lease_id, t) for lz, t in want]
    assert [lz.lease_id for lz, _ in got] == ["t0.1", "t4.1", "t5.1", "t6.1", "t7.1", "t8.0", "t9.0", "t10.0"]
    assert got[-1][1] == TASKSET.task(2), "seq 10 is the revisit of task 2"


def test_without_revisits_a_seq_is_its_taskset_index_and_a_finite_taskset_ends(tmp_path):
    q = queue(Catalog(tmp_path / "c.sqlite3", fsync=False), revisit=0.0, size=6)
    got = lease_batch(q, 10)
    assert got == [(i, TASKSET.task(i)) for i in range(6)]
    for seq, _ in got:
        q.complete(f"t{seq}.0", informative=True)
    assert not q.waiting and q.exhausted and q.next_batch() is None


def test_a_finite_taskset_ends_with_its_last_task_whatever_revisits_wait(tmp_path):
    q = queue(Catalog(tmp_path / "c.sqlite3", fsync=False), size=10)
    for _ in range(2):
        for seq, _ in lease_batch(q):
            q.complete(f"t{seq}.0", informative=True)
    third = lease_batch(q)  # seqs 8 and 9 take the taskset's last two tasks: the tasks end there
    assert third == [(8, TASKSET.task(8)), (9, TASKSET.task(9))] and q.exhausted and lease_batch(q) == []
    assert not q.batch_resolved(2)
    for seq, _ in third:
        q.complete(f"t{seq}.0", informative=True)
    assert q.batch_resolved(2) and q.next_batch() is None


def test_the_broker_issues_an_informative_task_again(broker_factory, clients):
    b = broker_factory("data.revisit=0.5", "data.batch_tasks=2", "sync.sync_style=async", "sync.max_staleness=100")
    ex = clients(b, "explorer", "ex")

    def lease(n):
        got = ex.request(P.LEASE, {"max_tasks": n, "policy_version": 0})
        assert got.command == P.TASKS, got.header
        return got.header["tasks"]

    first = lease(2)
    rewards = {0: [0.0, 1.0], 1: [1.0, 1.0]}  # the first was solved once in two, the second always
    for t in first:
        ex.put(group(t["lease_id"], rewards=rewards[t["seq"]], batch=t["batch_index"]), timeout=5)
    assert ex.request(P.STATUS).header["tasks"]["revisits"] == 1
    second, third = lease(2), lease(2)
    assert ex.request(P.STATUS).header["tasks"] == {"issued": 6, "leased": 4, "done": 2, "revisits": 0}
    assert [t["task"] for t in second + third[:1]] == [TASKSET.task(i) for i in (2, 3, 4)]
    assert third[1]["task"] == first[0]["task"] and third[1]["seq"] == 5 and third[1]["batch_index"] == 2

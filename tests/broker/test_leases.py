"""Leases of a holder dropped for silence: kept aside, and its again when it says HELLO with the same session,
unless another holder took the task, it is done, or the lease ran out meanwhile."""

from __future__ import annotations

import sqlite3

from rlbus.broker.catalog import Catalog
from rlbus.broker.tasks import TaskQueue
from rlbus.common.tasksets import ArithTaskset

ANY_BATCH = lambda batch: True  # noqa: E731


def queue(path) -> TaskQueue:
    return TaskQueue(Catalog(path, fsync=False), ArithTaskset(seed=0), 4, 60.0)


def ids(leases) -> list[str]:
    return sorted(lz.lease_id for lz in leases)


def test_a_holder_dropped_for_silence_gets_back_the_leases_nobody_took_as_they_were(tmp_path):
    q = queue(tmp_path / "c.sqlite3")
    granted = q.lease("a", 3, 0.0, ANY_BATCH, req=7, session="sa")
    assert [lz.lease_id for lz, _ in granted] == ["t0.0", "t1.0", "t2.0"]
    assert ids(q.release_holder("a", keep=True)) == ["t0.0", "t1.0", "t2.0"]
    assert [lz.lease_id for lz, _ in q.lease("b", 1, 1.0, ANY_BATCH, req=1, session="sb")] == ["t0.1"]

    released, restored = q.claim("a", "sa", 2.0)
    assert released == [] and ids(restored) == ["t1.0", "t2.0"]
    assert all((lz.req, lz.expires, lz.session) == (7, 60.0, "sa") for lz in restored)
    assert q.free == [] and not q.dropped
    # Its LEASE, resent on the new connection, is answered with them; a new LEASE gets the next fresh task.
    assert [(lz.lease_id, task) for lz, task in q.granted("a", 7, 2.0)] == [(lz.lease_id, t) for lz, t in granted[1:]]
    assert [lz.lease_id for lz, _ in q.lease("a", 1, 2.0, ANY_BATCH, req=8, session="sa")] == ["t3.0"]
    q.catalog.close()
    again = queue(tmp_path / "c.sqlite3")  # the catalogue has them: a restarted broker knows who holds what
    assert {lid: lz.holder for lid, lz in again.leases.items()} == {"t0.1": "b", "t1.0": "a", "t2.0": "a",
                                                                    "t3.0": "a"}


def test_no_lease_comes_back_to_another_session_after_a_bye_once_done_or_expired_or_unrecorded(tmp_path):
    q = queue(tmp_path / "c.sqlite3")
    q.lease("a", 2, 0.0, ANY_BATCH, session="sa")
    q.release_holder("a", keep=True)
    assert q.claim("a", "another process", 1.0) == ([], [])  # a new process under the name cannot know them
    assert q.claim("a", "sa", 60.0) == ([], [])  # ran out (lease_timeout_s) while it was away
    assert sorted(q.free) == [0, 1]

    q = queue(tmp_path / "d.sqlite3")
    q.lease("a", 2, 0.0, ANY_BATCH, session="sa")
    q.release_holder("a")  # BYE: it said it is gone
    assert q.claim("a", "sa", 1.0) == ([], [])

    q = queue(tmp_path / "e.sqlite3")
    q.lease("a", 2, 0.0, ANY_BATCH, session="sa")
    q.release_holder("a", keep=True)
    q.complete("t0.0")  # a group answering it is stored: the task is done
    full = q.catalog.lease

    def refuse(*_):
        raise sqlite3.OperationalError("database or disk is full")

    q.catalog.lease = refuse
    assert q.claim("a", "sa", 1.0) == ([], [])  # not recorded: t1 stays free, for any LEASE
    assert q.free == [1] and not q.leases
    q.catalog.lease = full
    assert ids(q.claim("a", "sa", 1.0)[1]) == ["t1.0"]

"""What the broker does when its catalogue cannot be written (a full or failing disk) for a change that is no
request a client could resend: a task done once its group is stored, leases given back, a held FETCH served
after a group commit. Unit tests, the disk failing through a catalogue method that raises as SQLite does on a
full disk; the real-disk counterparts, under a file size limit on a broker process, are in
tests/common/test_client.py."""

from __future__ import annotations

import sqlite3
import time

import zmq

from rlbus.broker.buffer import Buffer, HeldFetch
from rlbus.broker.catalog import Catalog
from rlbus.broker.peers import Peers
from rlbus.broker.store import Store
from rlbus.broker.tasks import TaskQueue
from rlbus.common import protocol as P
from rlbus.common.config import load_config
from rlbus.common.tasksets import ArithTaskset
from tests.conftest import group

ANY_BATCH = lambda batch: True  # noqa: E731


def full(*_):
    raise sqlite3.OperationalError("database or disk is full")


def test_a_task_done_or_a_lease_given_back_is_made_even_when_the_catalogue_refuses_it(tmp_path):
    q = TaskQueue(Catalog(tmp_path / "c.sqlite3", fsync=False), ArithTaskset(seed=0), 4, 60.0, revisit=0.5)
    q.lease("a", 4, 0.0, ANY_BATCH, session="sa")
    q.catalog.task_done = q.catalog.release = full
    q.complete("t0.0", informative=True)  # its group is stored: done, but no revisit the catalogue cannot hold
    assert 0 in q.done and "t0.0" not in q.leases and not q.waiting
    assert [lz.lease_id for lz in q.release_holder("a")] == ["t1.0", "t2.0", "t3.0"]
    assert not q.leases and sorted(q.free) == [1, 2, 3]
    q.catalog.close()
    # The catalogue is behind: a broker restarted now finds the leases out and task 0 not done.
    again = TaskQueue(Catalog(tmp_path / "c.sqlite3", fsync=False), ArithTaskset(seed=0), 4, 60.0)
    assert sorted(again.leases) == ["t0.0", "t1.0", "t2.0", "t3.0"] and again.unclaimed == {"a"}


class Replies:
    """The broker's socket, as the buffer answers through it."""

    def __init__(self):
        self.sent: list[tuple[bytes, str, dict]] = []

    def reply(self, identity, msg, command, header, payloads=None):
        self.sent.append((identity, command, header))

    def send(self, identity, frames):
        pass

    def bad(self, identity, exc, body):
        pass


def test_a_held_fetch_whose_batch_cannot_be_recorded_is_answered_storage_error_and_nothing_is_delivered(tmp_path):
    cfg = load_config(None, [f"buffer.dir={tmp_path}", "buffer.fsync=false"], environ={})
    store = Store(tmp_path / "buffer", fsync=False, cache_bytes=1 << 20)
    peers, replies = Peers(), Replies()
    peers.join(b"tr", {"role": "trainer", "name": "tr"}, time.time())
    tasks = TaskQueue(store.catalog, ArithTaskset(seed=0), 4, 60.0)
    buffer = Buffer(cfg, store, tasks, peers, replies, zmq.Context.instance())
    try:
        fetch = P.Message(P.FETCH, {"req": 5, "step": 0, "max_groups": 4, "min_groups": 2})
        buffer.held.append(HeldFetch(b"tr", fetch, time.time() + 60))
        store.put([group("g0") + group("g1")])
        store.catalog.deliver, deliver = full, store.catalog.deliver
        buffer.serve_held()
        assert [(who, command, h["code"], h["retry_after_s"]) for who, command, h in replies.sent] == [
            (b"tr", P.ERROR, "storage_error", cfg.broker.heartbeat_interval_s)]
        assert not buffer.held and not store.batches and sorted(store.ready) == ["g0", "g1"]
        store.catalog.deliver = deliver
        buffer.fetch(peers.get(b"tr"), fetch)  # the client's resend
        command, header = replies.sent[-1][1:]
        assert command == P.BATCH and sorted(g["group_id"] for g in header["groups"]) == ["g0", "g1"]
    finally:
        buffer.close()
        store.close()

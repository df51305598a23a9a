"""The catalogue's two writers (the broker's loop and its writer thread) take turns without SQLite's busy
handler: a write that finds the other's transaction under way waits for it to end, and is never refused."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from rlbus.broker import catalog as catalog_module
from rlbus.broker.catalog import Catalog


def test_a_write_during_the_other_threads_transaction_waits_for_it_and_is_not_refused(tmp_path, monkeypatch):
    connect = sqlite3.connect
    # No busy timeout: SQLite refuses ("database is locked") a write that meets another connection's at once.
    monkeypatch.setattr(sqlite3, "connect", lambda *a, **kw: connect(*a, **{**kw, "timeout": 0}))
    catalog = Catalog(tmp_path / "buffer.sqlite3", fsync=False)
    catalog.add_chunks([])  # opens the writer thread's own connection
    inside, release = threading.Event(), threading.Event()
    order: list[str] = []

    def writer() -> None:  # the writer thread's group commit, held open
        with catalog.transaction(catalog._wdb):
            catalog._wdb.execute("INSERT INTO chunks(segment, offset, entries) VALUES (0, 0, x'90')")
            inside.set()
            release.wait(10)
            order.append("group commit")

    t = threading.Thread(target=writer)
    t.start()
    assert inside.wait(10)
    loop = threading.Thread(target=lambda: (catalog.commit([], 3), order.append("loop's commit")))
    loop.start()
    loop.join(0.3)
    assert loop.is_alive() and order == []  # waiting its turn, not refused
    release.set()
    t.join(10)
    loop.join(10)
    assert order == ["group commit", "loop's commit"]
    assert catalog.get_meta("committed_step") == 3
    assert [c for c in catalog.chunks()] == [(0, 0, [])]
    catalog.close()


def test_a_write_that_waits_past_the_busy_timeout_fails_and_the_next_one_goes_through(tmp_path, monkeypatch):
    """A disk stopped under the other writer fails the request that waited (the broker answers it ERROR internal
    and serves on), as SQLite's own busy timeout would, instead of stopping the loop for as long as the disk."""
    monkeypatch.setattr(catalog_module, "BUSY_TIMEOUT_S", 0.2)
    catalog = Catalog(tmp_path / "buffer.sqlite3", fsync=False)
    catalog.add_chunks([])
    inside, release = threading.Event(), threading.Event()

    def stuck_writer() -> None:
        with catalog.transaction(catalog._wdb):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=stuck_writer)
    t.start()
    assert inside.wait(10)
    with pytest.raises(sqlite3.OperationalError, match="other writer has held it for 0.2 s"):
        catalog.commit([], 1)
    release.set()
    t.join(10)
    catalog.commit([], 2)
    assert catalog.get_meta("committed_step") == 2
    catalog.close()


def test_a_catalogue_from_before_leases_kept_their_request_and_session_is_read_and_extended(tmp_path):
    """Leases recorded without the request that granted them and their holder's session (an older broker's
    catalogue) read back with neither, read-only too, and the broker's own connection adds the two columns."""
    path = tmp_path / "buffer.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE tasks (seq INTEGER PRIMARY KEY, lease_id TEXT, holder TEXT, expires REAL, "
               "attempt INTEGER NOT NULL, done INTEGER NOT NULL DEFAULT 0)")
    db.execute("INSERT INTO tasks VALUES (0, 't0.0', 'ex', 99.0, 0, 0)")
    db.commit()
    db.close()
    old = (0, "t0.0", "ex", 99.0, 0, False, None, None)
    reader = Catalog(path, fsync=False, readonly=True)
    assert list(reader.tasks()) == [old]
    reader.close()
    catalog = Catalog(path, fsync=False)
    assert list(catalog.tasks()) == [old]
    catalog.lease([(1, "t1.0", "ex", 99.0, 0, 7, "s-1")])
    assert list(catalog.tasks()) == [old, (1, "t1.0", "ex", 99.0, 0, False, 7, "s-1")]

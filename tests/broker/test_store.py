"""The store's write path under partial writes, failed opens and failed syncs: what was committed stays
readable, and nothing is reported durable that a failed sync may have dropped.

Faults are injected into the store's own system calls (a unit test: the
real-disk counterpart is the SIGKILL test in test_crash.py).
"""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import zmq

from rlbus.broker import segments, store as S, writer as W
from tests.conftest import group


def put(store: S.Store, gid: str, size: int = 2, payload: bytes | None = None):
    items = [(m, payload if payload is not None else p) for m, p in group(gid, size=size)]
    return store.put([items])


def readable(store: S.Store) -> dict[str, bytes]:
    return {t.id: bytes(store.payload(t)) for g in store.groups.values() for t in g.trajs}


def reopened(path) -> dict[str, bytes]:
    store = S.Store(path, cache_bytes=0)
    try:
        return readable(store)
    finally:
        store.close()


def test_empty_payloads_are_stored_and_read_back(tmp_path):
    store = S.Store(tmp_path, cache_bytes=0)
    put(store, "e", payload=b"")
    put(store, "f")
    store.close()
    assert reopened(tmp_path) == {"e.0": b"", "e.1": b"", "f.0": b"payload-of-f.0", "f.1": b"payload-of-f.1"}


def test_a_failed_write_leaves_earlier_and_later_data_intact(tmp_path, monkeypatch):
    """A write that fails half way (ENOSPC) is refused; the next writes land where their metadata says."""
    store = S.Store(tmp_path, cache_bytes=0)
    put(store, "before")
    real = os.pwritev
    calls = {"n": 0}

    def half_then_fail(fd, buffers, offset):
        calls["n"] += 1
        real(fd, [bytes(buffers[0])[:3]], offset)  # a partial append...
        raise OSError(errno.ENOSPC, "No space left on device")  # ...then the disk is full

    monkeypatch.setattr(segments.os, "pwritev", half_then_fail)
    with pytest.raises(OSError):
        put(store, "lost")
    monkeypatch.setattr(segments.os, "pwritev", real)
    assert calls["n"] == 1
    put(store, "after")
    assert set(readable(store)) == {"before.0", "before.1", "after.0", "after.1"}
    store.close()
    assert reopened(tmp_path) == {f"{g}.{i}": f"payload-of-{g}.{i}".encode() for g in ("before", "after")
                                  for i in range(2)}


def test_a_failed_open_at_segment_rollover_keeps_the_writer_usable(tmp_path, monkeypatch):
    store = S.Store(tmp_path, segment_bytes=16, cache_bytes=0)
    put(store, "a")  # fills segment 0 past its size: the next chunk goes to a new segment
    real = os.open

    def refuse_new_segments(path, flags, *args):
        if str(path).endswith(".seg") and flags & os.O_WRONLY:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(path, flags, *args)

    monkeypatch.setattr(segments.os, "open", refuse_new_segments)
    with pytest.raises(OSError):
        put(store, "b")
    monkeypatch.setattr(segments.os, "open", real)
    put(store, "c")
    put(store, "d")
    store.close()
    assert reopened(tmp_path) == {f"{g}.{i}": f"payload-of-{g}.{i}".encode() for g in "acd" for i in range(2)}


def submit(writer: W.Writer, store: S.Store, gid: str) -> S.WriteJob:
    job = store.prepare([[(m, p) for m, p in group(gid)]])
    writer.submit(job)
    return job


def outcomes(writer: W.Writer, n: int, timeout: float = 10.0) -> dict[str, str | None]:
    """gid -> error (None: durable) of the next n jobs the writer finishes."""
    done: dict[str, str | None] = {}
    deadline = time.monotonic() + timeout
    while len(done) < n and time.monotonic() < deadline:
        writer.done.poll(100)
        for job, error in writer.completed():
            done[job.chunks[0][0].meta["group_id"]] = error
    return done


def test_the_writer_appends_the_next_commit_while_the_last_one_syncs_and_a_failed_sync_fails_both(
        tmp_path, monkeypatch):
    """A failed fdatasync may have dropped any page written before it returned: the commit appended
    meanwhile is refused too, though its own sync would succeed; the next one is stored."""
    store = S.Store(tmp_path, fsync="group", cache_bytes=0)
    writer = W.Writer(store, zmq.Context.instance())
    real, syncing, release = os.fdatasync, threading.Event(), threading.Event()

    def first_sync_blocks_then_fails(fd):
        if not syncing.is_set():
            syncing.set()
            release.wait(10)
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(segments.os, "fdatasync", first_sync_blocks_then_fails)
    try:
        submit(writer, store, "a")
        assert syncing.wait(10), "the first commit never reached its sync"
        submit(writer, store, "b")
        deadline = time.monotonic() + 10
        while writer._appended.qsize() == 0 and time.monotonic() < deadline:  # b written beside a's sync
            time.sleep(0.01)
        assert writer._appended.qsize() == 1, "the next commit was not appended while the last one synced"
        release.set()
        done = outcomes(writer, 2)
        assert set(done) == {"a", "b"} and all(e and "Input/output error" in e for e in done.values()), done
        submit(writer, store, "c")
        assert outcomes(writer, 1) == {"c": None}
    finally:
        release.set()
        writer.stop()
        writer.done.close(0)
        store.close()
    assert reopened(tmp_path) == {"c.0": b"payload-of-c.0", "c.1": b"payload-of-c.1"}

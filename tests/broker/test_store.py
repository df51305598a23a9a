"""The store's write path under partial writes and failed opens: what was committed stays readable.

Faults are injected into the store's own system calls (a unit test: the
real-disk counterpart is the SIGKILL test in test_crash.py).
"""

from __future__ import annotations

import errno
import os

import pytest

from rlbus.broker import segments, store as S
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

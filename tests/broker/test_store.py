"""The store's write path under partial writes and failed opens: what was committed stays readable.

Faults are injected into the store's own system calls (a unit test: the
real-disk counterpart is the SIGKILL test in test_crash.py).
"""

from __future__ import annotations

import errno
import os
import random
import zlib

import numpy as np
import pytest

from rlbus.broker import segments, store as S
from rlbus.common import protocol as P
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


@pytest.mark.parametrize("fsync", ["group", "off"])
def test_a_failed_write_leaves_earlier_and_later_data_intact(tmp_path, monkeypatch, fsync):
    """A write that fails half way (ENOSPC) is refused; the next writes land where their metadata says.

    With fsync the segment log writes directly (aligned blocks), without it through the page cache."""
    store = S.Store(tmp_path, fsync=fsync, cache_bytes=0)
    assert store.segments.direct == (fsync == "group")
    put(store, "before")
    real = os.pwritev
    calls = {"n": 0}

    def half_then_fail(fd, data, offset):
        calls["n"] += 1
        # a first block of a direct write, a partial append of a buffered one...
        real(fd, [data[0][:segments.ALIGN] if store.segments.direct else bytes(data[0])[:3]], offset)
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


def test_direct_writes_keep_every_payload_of_several_group_commits_in_one_write(tmp_path, monkeypatch):
    """Odd-sized payloads, three jobs written together, a run larger than the staging buffer: each job
    starts on a block boundary, the file grows in whole blocks, every payload reads back whole."""
    monkeypatch.setattr(segments, "STAGE_BYTES", 4 * segments.ALIGN)  # force runs through several pieces
    store = S.Store(tmp_path, cache_bytes=0)
    assert store.segments.direct
    rng = random.Random(7)
    expected, jobs = {}, []
    for j, sizes in enumerate([[1, 4095, 4097], [0, 3], [5 * segments.ALIGN + 11, 17]]):
        items = []
        for i, (meta, _) in enumerate(group(f"j{j}", size=len(sizes))):
            expected[meta["id"]] = payload = rng.randbytes(sizes[i])
            items.append((meta, payload))
        jobs.append(store.prepare([items]))
    store.write(jobs)
    for job in jobs:
        assert job.chunks[0][0].offset % segments.ALIGN == 0
        store.finish(job)
    path = next((tmp_path / "segments").glob("*.seg"))
    assert path.stat().st_size % segments.ALIGN == 0
    assert readable(store) == expected
    store.close()
    assert reopened(tmp_path) == expected


def test_payloads_as_views_of_one_frame_or_as_one_shared_object_are_written_and_served_whole(tmp_path):
    """Neighbours in one PUT frame are written and sent as one piece; a resend leaves a gap that is
    not bridged, and one bytes object given for several trajectories is each one's payload."""
    store = S.Store(tmp_path)
    shared = b"the-same-bytes"
    put(store, "s", size=3, payload=shared)
    metas = [m for m, _ in group("f", size=4)]
    payloads = [f"payload-{i}-".encode() * (i + 1) for i in range(4)]
    views = P.split_payloads(metas, P.join_payloads(metas, payloads))
    alone = dict(metas[1])
    store.put([[(alone, P.split_payloads([alone], P.join_payloads([alone], [payloads[1]]))[0])]])  # a resend next
    store.put([list(zip(metas, views))])
    expected = {"s.0": shared, "s.1": shared, "s.2": shared} | {m["id"]: p for m, p in zip(metas, payloads)}
    assert readable(store) == expected
    for gid in ("s", "f"):
        trajs = store.groups[gid].trajs
        served = b"".join(bytes(f) for f in store.payload_frames(trajs))
        assert served == b"".join(expected[t.id] for t in trajs), f"a BATCH of group {gid} would be cut or joined"
    assert len(store.payload_frames(store.groups["f"].trajs[1:])) == 2  # f.0, then f.2 and f.3 as one piece
    store.close()
    assert reopened(tmp_path) == expected


def test_a_filesystem_without_direct_writes_gets_buffered_ones(tmp_path, monkeypatch):
    real = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args)

    monkeypatch.setattr(segments.os, "open", no_direct)
    store = S.Store(tmp_path, cache_bytes=0)
    put(store, "a")
    assert not store.segments.direct
    put(store, "b")
    store.close()
    assert reopened(tmp_path) == {f"{g}.{i}": f"payload-of-{g}.{i}".encode() for g in "ab" for i in range(2)}


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


def test_payload_checksums_are_zlibs_crc32():
    """Segments written with zlib's crc32 read back: the checksum's values must never change."""
    rng = random.Random(3)
    for size in (0, 1, 63, 4096, 8872, 1 << 18):
        data = rng.randbytes(size)
        assert segments.crc32(data) == zlib.crc32(data)
        assert segments.crc32(memoryview(data)[1:]) == zlib.crc32(data[1:])


def test_a_buffers_address_is_where_its_first_byte_lies_read_only_or_not():
    """Placement of large PUTs reads where a frame lies in memory; the broker asks the buffer itself (no numpy)."""
    memory = np.zeros(3 * segments.ALIGN, np.uint8)
    base = memory.ctypes.data
    assert segments.address(memoryview(memory)[100:]) == base + 100
    frozen = memory[7:].copy()
    frozen.flags.writeable = False  # read-only, as a payload given as `bytes` is
    assert segments.address(memoryview(frozen)[5:9]) == frozen.ctypes.data + 5
    data = bytes(5000)
    assert segments.address(memoryview(data)[17:]) == np.frombuffer(data, np.uint8).ctypes.data + 17
    assert segments.address(memoryview(b"")) == 0
    with pytest.raises(BufferError):
        segments.address(memoryview(memory)[::2])  # not contiguous: no one address says where its bytes are


def refusal(store: S.Store, *puts: list) -> list[str | None]:
    """`refuse_join` over the PUTs of one drain, in order (each a list of trajectory metadata)."""
    adding, sizes, seen = S.Counter(), {}, set()
    return [store.refuse_join(metas, adding, sizes, seen) for metas in puts]


def test_a_group_takes_exactly_its_size_within_and_across_puts_of_one_drain(tmp_path):
    store = S.Store(tmp_path)
    metas = [m for m, _ in group("g", size=3)]
    assert refusal(store, metas[:2], metas[2:]) == [None, None]
    extra = dict(metas[0], id="g.3")
    assert "has all its 3 samples" in refusal(store, metas, [extra])[1]
    assert "has all its 3 samples" in refusal(store, metas + [extra])[0]
    assert refusal(store, metas + metas) == [None], "a resend within the PUT is a duplicate, not a fourth sample"


def test_a_sample_that_disagrees_about_its_groups_size_is_refused(tmp_path):
    store = S.Store(tmp_path)
    metas = [m for m, _ in group("g", size=2)]
    odd = dict(metas[1], group_size=3)
    assert "has group_size 2, this trajectory says 3" in refusal(store, [metas[0], odd])[0]  # in one PUT
    assert "has group_size 2" in refusal(store, [metas[0]], [odd])[1]  # in a later PUT of the drain
    put(store, "h", size=2)
    assert "has group_size 2" in refusal(store, [dict(metas[0], id="h.9", group_id="h", group_size=3)])[0]


def test_no_sample_joins_a_group_that_is_stored_whole_or_being_written(tmp_path):
    store = S.Store(tmp_path)
    put(store, "done", size=2)
    late = dict(group("done", size=2)[0][0], id="done.2")
    assert "complete already" in refusal(store, [late])[0]
    assert refusal(store, [m for m, _ in group("done", size=2)]) == [None], "a resend of stored ids"
    job = store.prepare([group("w", size=2)[:1]])  # one sample of "w" being written
    assert job is not None
    metas = [m for m, _ in group("w", size=2)]
    assert refusal(store, [metas[1]]) == [None]
    assert "has all its 2 samples" in refusal(store, [dict(metas[1], id="w.7")], [dict(metas[1], id="w.8")])[1]


def test_a_large_put_is_written_from_its_frame_and_a_small_one_stays_back_to_back(tmp_path, monkeypatch):
    """Direct writes: a PUT of 256 KB or more goes at the offset within a block that its frame has in memory
    (here 56 bytes past a page, as a message buffer lies), so only the bytes at its ends are copied into the
    staging buffer; a small PUT goes where the last one ended. A resend inside a frame breaks its payloads in
    two pieces, the second no longer where its place wants it: copied. Everything reads back whole."""
    copied = []
    real_copy = segments._Blocks.copy
    monkeypatch.setattr(segments._Blocks, "copy", lambda self, data: (copied.append(len(data)), real_copy(self, data)))
    store = S.Store(tmp_path, cache_bytes=0)
    rng = random.Random(3)
    expected = {}

    def frame(gid: str, sizes: list[int], skip: int = 0):
        metas = [m for m, _ in group(gid, size=len(sizes))]
        payloads = [rng.randbytes(n) for n in sizes]
        joined = P.join_payloads(metas, payloads)
        memory = np.zeros(len(joined) + 2 * segments.ALIGN, np.uint8)
        at = (-memory.ctypes.data) % segments.ALIGN + 56  # 56 bytes past a block
        message = memory[at:at + len(joined)]  # an object of its own, as a received frame is
        message[:] = np.frombuffer(joined, np.uint8)
        views = P.split_payloads(metas, memoryview(message))
        expected.update((m["id"], p) for m, p in zip(metas, payloads))
        return list(zip(metas, views))[skip:]

    big = frame("big", [100_000, 100_001, 100_002])
    job = store.prepare([big])
    store.write([job])
    store.finish(job)
    first = job.chunks[0][0]
    assert first.offset % segments.ALIGN == 56, "placed as it lies in memory"
    assert sum(copied) < 2 * segments.ALIGN, copied
    copied.clear()
    small = frame("small", [300, 301])
    job = store.prepare([small])
    assert job.chunks[0][0].offset % segments.ALIGN == 0, "a group commit starts on a block; a small PUT stays there"
    store.write([job])
    store.finish(job)
    assert sum(copied) == 601
    copied.clear()
    resent = frame("resent", [120_000] * 3)
    store.put([resent[:1]])  # the first payload alone (small: copied), then the whole frame again
    store.put([resent])
    assert sum(copied) >= 3 * 120_000, "the other two lie 120,000 bytes past where the frame's place wants them"
    assert readable(store) == expected
    store.close()
    assert reopened(tmp_path) == expected

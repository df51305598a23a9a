"""The broker's segment log: trajectory payloads in append-only files, `segments/NNNNNNNN.seg`.

The loop places each payload (`place`), the writer thread writes runs of
them where they were placed and syncs (`write`), and reads check each
payload against the CRC the catalogue recorded (`read`). Bytes written but
never recorded in the catalogue are unreachable garbage; each start opens a
new segment past them.

With `fsync` on, writes bypass the page cache (O_DIRECT): every write is
synced anyway, and copying the bytes into the page cache costs the kernel
several times the CPU of staging them in an aligned buffer. O_DIRECT needs
offsets, lengths and memory in whole blocks, so each group commit starts on
a block boundary (`align`) and its last block is padded with zeros. A large
PUT is placed at the offset within a block that its frame has in memory
(`start_chunk`), so the whole blocks of its payloads are written from the
frame itself, and only the bytes at its two ends, and small PUTs, are
copied into an aligned buffer: one system call for all. A filesystem
without O_DIRECT (tmpfs, some network and overlay filesystems) gets the
buffered path, logged once.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

import structlog
from zlib_ng import zlib_ng

log = structlog.get_logger()

ALIGN = 4096  # O_DIRECT offsets, lengths and buffer addresses: whole blocks (4 KB covers 512 B and 4 KB devices)
STAGE_BYTES = 8 << 20  # the aligned buffer direct writes copy bytes into, written when full
DIRECT_MIN = 4 * ALIGN  # smaller payloads are copied whatever their place: not worth another piece
LIE_LIKE_MIN = 64 * ALIGN  # a chunk placed for direct writes from memory wastes under 1/64 of it
_ZEROS = bytes(ALIGN)

# zlib's CRC-32, from zlib-ng: the same values (segments written before read back as they were), computed
# with the CPU's carry-less multiply at tens of GB/s where zlib's own runs at about 4.
crc32 = zlib_ng.crc32

Run = tuple[int, list[memoryview]]  # (offset, payloads back to back from there)


class SegmentLog:
    def __init__(self, directory: str | Path, fsync: bool, segment_bytes: int):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.direct = fsync  # O_DIRECT writes, until the filesystem refuses them
        self.segment_bytes = segment_bytes
        existing = [int(p.stem) for p in self.dir.glob("*.seg")]
        self.segment, self.offset = max(existing, default=-1) + 1, 0
        self._wfd: tuple[int, int] | None = None
        self._readers: dict[int, int] = {}
        self._stage: mmap.mmap | None = None

    def _path(self, segment: int) -> Path:
        return self.dir / f"{segment:08d}.seg"

    def align(self) -> None:
        """A group commit starts on a block boundary when writes are direct (the gap is never read)."""
        if self.direct:
            self.offset = -(-self.offset // ALIGN) * ALIGN

    def start_chunk(self, first: memoryview | bytes = b"", size: int = 0) -> None:
        """A chunk's payloads stay in one segment: roll over to a new one first if this one is full.

        Direct writes: a chunk of at least `LIE_LIKE_MIN` bytes (`size`) goes at the offset within a block
        that its `first` payload has in memory, so that the whole blocks of its payloads (back to back in a
        PUT's frame) are written from there, not copied; the gap before it, under a block, is never read.
        """
        if self.offset >= self.segment_bytes:
            self.segment, self.offset = self.segment + 1, 0
        if self.direct and size >= LIE_LIKE_MIN:
            self.offset += (address(memoryview(first)) - self.offset) % ALIGN

    def place(self, size: int) -> tuple[int, int]:
        """(segment, offset) where the next payload of `size` bytes goes."""
        where = (self.segment, self.offset)
        self.offset += size
        return where

    def write(self, runs: dict[int, list[Run]]) -> None:
        """Write each run (offset, payloads back to back) into its segment, then sync (writer thread).

        Each run goes where it was placed, not wherever the file ends: bytes of a failed write
        (ENOSPC, EIO) are then unreferenced garbage, and what was placed after them still lands at
        the offsets the catalogue records.
        """
        for segment, segment_runs in runs.items():
            fd = self._writer_fd(segment)
            if self.direct:
                try:
                    self._write_direct(fd, segment_runs)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    fd = self._buffered_from_now(segment, f"direct write refused: {exc}")
            if not self.direct:
                for offset, payloads in segment_runs:
                    _write_all(fd, payloads, offset)
            if self.fsync:
                os.fdatasync(fd)

    def _writer_fd(self, segment: int) -> int:
        if self._wfd is None or self._wfd[0] != segment:
            flags = os.O_WRONLY | os.O_CREAT
            try:  # may fail: the old descriptor stays
                fd = os.open(self._path(segment), flags | (os.O_DIRECT if self.direct else 0), 0o644)
            except OSError as exc:
                if not self.direct or exc.errno != errno.EINVAL:
                    raise
                self._direct_refused(str(exc))
                fd = os.open(self._path(segment), flags, 0o644)
            old, self._wfd = self._wfd, (segment, fd)
            if old is not None:
                os.close(old[1])
        return self._wfd[1]

    def _direct_refused(self, why: str) -> None:
        """This filesystem has no O_DIRECT: buffered writes from now on, said once."""
        log.warning("segment_direct_io_unavailable", dir=str(self.dir), error=why)
        self.direct = False

    def _buffered_from_now(self, segment: int, why: str) -> int:
        """The filesystem took O_DIRECT at open but not at write: reopen buffered and stay so."""
        self._direct_refused(why)
        if self._wfd is not None:
            os.close(self._wfd[1])
            self._wfd = None
        return self._writer_fd(segment)

    def _write_direct(self, fd: int, runs: list[Run]) -> None:
        """Write runs in whole blocks: a payload's whole blocks from where it lies in memory when it lies at
        the offset within a block it has in the file (`start_chunk` placed it so), every other byte through the
        aligned staging buffer.

        Runs closer than a block are written as one, with zeros between them (the padding of the
        earlier run's last block); every other run is written from the start of its first block, zeros
        before it (a group commit starts on a block of its own, `align`, up to a block before its first run).
        """
        if self._stage is None:
            self._stage = mmap.mmap(-1, STAGE_BYTES)  # page-aligned, as O_DIRECT needs
        out = _Blocks(fd, memoryview(self._stage), runs[0][0] - runs[0][0] % ALIGN)
        try:
            for offset, payloads in runs:
                gap = offset - out.end
                if not 0 <= gap < ALIGN:  # from the block it starts in, which holds nothing before it
                    out.write(pad=True)
                    out.base, gap = offset - offset % ALIGN, offset % ALIGN
                out.copy(memoryview(_ZEROS)[:gap])
                for payload in payloads:
                    view = memoryview(payload).cast("B")
                    head = (-address(view)) % ALIGN if len(view) >= DIRECT_MIN else -1
                    if head < 0 or (out.end + head) % ALIGN:
                        out.copy(view)
                        continue
                    whole = head + (len(view) - head) // ALIGN * ALIGN
                    out.copy(view[:head])
                    out.direct(view[head:whole])
                    out.copy(view[whole:])
            out.write(pad=True)
        finally:
            out.release()

    def read(self, segment: int, offset: int, length: int, crc: int, what: str) -> bytes:
        fd = self._readers.get(segment)
        if fd is None:
            fd = self._readers[segment] = os.open(self._path(segment), os.O_RDONLY)
        data = os.pread(fd, length, offset)
        if len(data) != length or crc32(data) != crc:
            raise IOError(f"payload of {what} in segment {segment} is damaged (crc mismatch)")
        return data

    def close(self) -> None:
        if self._wfd is not None:
            os.close(self._wfd[1])
            self._wfd = None
        for fd in self._readers.values():
            os.close(fd)
        self._readers.clear()
        if self._stage is not None:
            self._stage.close()
            self._stage = None


class _PyBuffer(ctypes.Structure):
    """CPython's Py_buffer (stable ABI since 3.11): what a buffer export says of its memory."""

    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_PYBUF_SIMPLE = 0  # a contiguous buffer of bytes; anything else raises BufferError


def address(view: memoryview) -> int:
    """Where a contiguous buffer's first byte lies in memory, read-only (a `bytes` payload) or not.

    Asked of the buffer itself through the C API. numpy's `ctypes.data` says it too, but importing numpy for it
    held the broker's first large PUT about 0.1 s longer on the loop and kept 10 MB more resident."""
    if not len(view):
        return 0
    info = _PyBuffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(view), ctypes.byref(info), _PYBUF_SIMPLE)
    try:
        return info.buf
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(info))


class _Blocks:
    """The file's bytes from `base` on, gathered for one system call in whole blocks at aligned addresses:
    pieces of the staging buffer (bytes copied there) and a payload's own whole blocks (no copy)."""

    def __init__(self, fd: int, stage: memoryview, base: int):
        self.fd, self.stage, self.base = fd, stage, base
        self.pieces: list[memoryview] = []
        self.gathered = 0  # bytes in `pieces`
        self.start = self.used = 0  # the open piece: stage[start:used], after `pieces` in the file

    @property
    def end(self) -> int:
        """The file offset of the next byte."""
        return self.base + self.gathered + self.used - self.start

    def copy(self, data: memoryview) -> None:
        while len(data):
            n = min(len(data), len(self.stage) - self.used)
            self.stage[self.used:self.used + n] = data[:n]
            self.used += n
            data = data[n:]
            if self.used == len(self.stage):
                self.write()

    def direct(self, blocks: memoryview) -> None:
        """Whole blocks at an aligned address, to go at `end`, a block boundary."""
        self._close()
        self.pieces.append(blocks)
        self.gathered += len(blocks)

    def _close(self) -> None:
        if self.used > self.start:  # the open piece starts on a block boundary of the stage and ends on one
            self.pieces.append(self.stage[self.start:self.used])
            self.gathered += self.used - self.start
            self.start = self.used

    def write(self, pad: bool = False) -> None:
        """Write what is gathered (`pad`: its last block filled with zeros first); the stage is free again."""
        if pad:
            end = -(-self.used // ALIGN) * ALIGN
            self.stage[self.used:end] = _ZEROS[:end - self.used]
            self.used = end
        self._close()
        if self.pieces:
            _write_all(self.fd, self.pieces, self.base, blocks=True)
        self.base += self.gathered
        self.pieces, self.gathered, self.start, self.used = [], 0, 0, 0

    def release(self) -> None:
        self.pieces = []
        self.stage.release()


def _write_all(fd: int, buffers: list[bytes | memoryview], offset: int, blocks: bool = False) -> None:
    """Write every buffer in order from `offset`, with as few system calls as the OS allows; `blocks`: a
    direct write, where a short write that leaves a part block fails."""
    limit = os.sysconf("SC_IOV_MAX")
    pending = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]  # empty payloads add nothing
    i = 0
    while i < len(pending):
        written = os.pwritev(fd, pending[i:i + limit], offset)
        if written <= 0:
            raise OSError(errno.EIO, f"pwritev wrote nothing at offset {offset} of a segment")
        if blocks and written % ALIGN:
            raise OSError(errno.EIO, f"a direct write at offset {offset} wrote {written} bytes, not whole blocks")
        offset += written
        while written:
            n = len(pending[i])
            if written >= n:
                written -= n
                i += 1
            else:  # a short write: go on from the middle of this buffer
                pending[i] = pending[i][written:]
                written = 0

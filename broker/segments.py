"""The broker's segment log: trajectory payloads in append-only files, `segments/NNNNNNNN.seg`.

The loop places each payload (`place`), the writer thread writes runs of
them where they were placed and syncs (`write`), and reads check each
payload against the CRC the catalogue recorded (`read`). Bytes written but
never recorded in the catalogue are unreachable garbage; each start opens a
new segment past them.

With `fsync` on, writes bypass the page cache (O_DIRECT): every write is
synced anyway, and copying the bytes into the page cache costs the kernel
several times the CPU of staging them in an aligned buffer. O_DIRECT needs
offsets and lengths in whole blocks, so each group commit starts on a block
boundary (`align`) and its last block is padded with zeros. A filesystem
without O_DIRECT (tmpfs, some network and overlay filesystems) gets the
buffered path, logged once.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import structlog
from zlib_ng import zlib_ng

log = structlog.get_logger()

ALIGN = 4096  # O_DIRECT offsets, lengths and buffer addresses: whole blocks (4 KB covers 512 B and 4 KB devices)
STAGE_BYTES = 8 << 20  # the aligned buffer direct writes go through, in pieces of at most this
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

    def start_chunk(self) -> None:
        """A chunk's payloads stay in one segment: roll over to a new one first if this one is full."""
        if self.offset >= self.segment_bytes:
            self.segment, self.offset = self.segment + 1, 0

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
        """Write runs through the aligned staging buffer, in whole blocks.

        Runs closer than a block are written as one, with zeros between them (the padding of the
        earlier run's last block); every other run starts on a block boundary, as `align` placed it.
        """
        if self._stage is None:
            self._stage = mmap.mmap(-1, STAGE_BYTES)  # page-aligned, as O_DIRECT needs
        stage = memoryview(self._stage)
        base, used = runs[0][0], 0  # `stage[:used]` holds the file's bytes from `base`

        def add(data: memoryview) -> None:
            nonlocal base, used
            while len(data):
                n = min(len(data), STAGE_BYTES - used)
                stage[used:used + n] = data[:n]
                used += n
                data = data[n:]
                if used == STAGE_BYTES:
                    _pwrite_all(fd, stage, base)
                    base, used = base + STAGE_BYTES, 0

        def flush() -> None:
            nonlocal used
            if used:
                end = -(-used // ALIGN) * ALIGN
                stage[used:end] = _ZEROS[:end - used]
                _pwrite_all(fd, stage[:end], base)
                used = 0

        try:
            for offset, payloads in runs:
                gap = offset - (base + used)
                if 0 <= gap < ALIGN:
                    add(memoryview(_ZEROS)[:gap])
                else:
                    flush()
                    if offset % ALIGN:
                        raise ValueError(f"a direct write must start on a block boundary, not at {offset}")
                    base = offset
                for payload in payloads:
                    add(memoryview(payload).cast("B"))
            flush()
        finally:
            stage.release()

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


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write whole blocks from an aligned buffer; a short direct write that leaves a part block fails."""
    while len(data):
        written = os.pwrite(fd, data, offset)
        if written <= 0 or (written < len(data) and written % ALIGN):
            raise OSError(errno.EIO, f"direct write of {len(data)} bytes at offset {offset} wrote {written}")
        data, offset = data[written:], offset + written


def _write_all(fd: int, buffers: list[bytes | memoryview], offset: int) -> None:
    """Write every buffer in order from `offset`, with as few system calls as the OS allows."""
    limit = os.sysconf("SC_IOV_MAX")
    pending = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]  # empty payloads add nothing
    i = 0
    while i < len(pending):
        written = os.pwritev(fd, pending[i:i + limit], offset)
        if written <= 0:
            raise OSError(f"pwritev wrote nothing at offset {offset} of a segment")
        offset += written
        while written:
            n = len(pending[i])
            if written >= n:
                written -= n
                i += 1
            else:  # a short write: go on from the middle of this buffer
                pending[i] = pending[i][written:]
                written = 0

"""The broker's segment log: trajectory payloads in append-only files, `segments/NNNNNNNN.seg`.

The loop places each payload (`place`), the writer thread writes runs of
them where they were placed and syncs (`write`), and reads check each
payload against the CRC the catalogue recorded (`read`). Bytes written but
never recorded in the catalogue are unreachable garbage; each start opens a
new segment past them.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path


class SegmentLog:
    def __init__(self, directory: str | Path, fsync: bool, segment_bytes: int):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        existing = [int(p.stem) for p in self.dir.glob("*.seg")]
        self.segment, self.offset = max(existing, default=-1) + 1, 0
        self._wfd: tuple[int, int] | None = None
        self._readers: dict[int, int] = {}

    def _path(self, segment: int) -> Path:
        return self.dir / f"{segment:08d}.seg"

    def start_chunk(self) -> None:
        """A chunk's payloads stay in one segment: roll over to a new one first if this one is full."""
        if self.offset >= self.segment_bytes:
            self.segment, self.offset = self.segment + 1, 0

    def place(self, size: int) -> tuple[int, int]:
        """(segment, offset) where the next payload of `size` bytes goes."""
        where = (self.segment, self.offset)
        self.offset += size
        return where

    def write(self, runs: dict[int, list[tuple[int, list[memoryview]]]]) -> None:
        """Write each run (offset, payloads back to back) into its segment, then sync (writer thread).

        Each run goes where it was placed, not wherever the file ends: bytes of a failed write
        (ENOSPC, EIO) are then unreferenced garbage, and what was placed after them still lands at
        the offsets the catalogue records.
        """
        for segment, segment_runs in runs.items():
            fd = self._writer_fd(segment)
            for offset, payloads in segment_runs:
                _write_all(fd, payloads, offset)
            if self.fsync:
                os.fdatasync(fd)

    def _writer_fd(self, segment: int) -> int:
        if self._wfd is None or self._wfd[0] != segment:
            fd = os.open(self._path(segment), os.O_WRONLY | os.O_CREAT, 0o644)  # may fail: the old one stays
            old, self._wfd = self._wfd, (segment, fd)
            if old is not None:
                os.close(old[1])
        return self._wfd[1]

    def read(self, segment: int, offset: int, length: int, crc: int, what: str) -> bytes:
        fd = self._readers.get(segment)
        if fd is None:
            fd = self._readers[segment] = os.open(self._path(segment), os.O_RDONLY)
        data = os.pread(fd, length, offset)
        if len(data) != length or zlib.crc32(data) != crc:
            raise IOError(f"payload of {what} in segment {segment} is damaged (crc mismatch)")
        return data

    def close(self) -> None:
        if self._wfd is not None:
            os.close(self._wfd[1])
            self._wfd = None
        for fd in self._readers.values():
            os.close(fd)
        self._readers.clear()


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

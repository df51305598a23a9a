"""A fetch the engine reloads from while it is still arriving.

An explorer that fetches a version would otherwise wait for the last chunk,
then read the files again into the engine: the two take about as long as
each other on the default model. With `Receiver` overlapping them, the
engine's workers start reloading as soon as the fetch has written the
safetensors header, and take each tensor once every chunk under it has
arrived and matched its hash.

The two sides are different processes (the fetch runs in the explorer, the
reload in vLLM's workers), so they meet in a small progress file beside the
fetch directory, replaced atomically on every change:

    {"state": "running" | "done" | "failed", "dir": where the files are,
     "ready": {file name: bytes from the start that are in place}, "error": str}

`StreamProgress` writes it (weights/fetch.py calls it as chunks land);
`streamed_tensors` reads it inside a worker. Whole files become ready chunk
by chunk in the fetch's work directory; a file that comes as a delta becomes
ready at once, when the version is complete (the delta is applied over the
whole file). A worker never reads a byte the progress does not cover, and
gives up when the fetch fails or the progress stops moving for `timeout_s`.
A version whose digest then fails was loaded from checked chunks of the
wrong version: the receiver loads the version it held before, so the engine
never keeps weights it did not announce.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any, Iterator

POLL_S = 0.001
DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
          "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


class StreamFailed(Exception):
    """The fetch the engine was reloading from failed, or stopped making progress."""


class StreamProgress:
    """The fetching side: what of each weights file is in place, written to `path` for the workers to read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.files: list[dict[str, Any]] = []
        self.chunk_bytes = 0
        self._next: dict[int, int] = {}  # whole weights file -> its first chunk not yet in place
        self._have: set[tuple[int, int]] = set()
        self._state: dict[str, Any] = {"state": "running", "dir": "", "ready": {}, "error": ""}

    def start(self, work: Path, files: list[dict[str, Any]], chunk_bytes: int, todo: list[tuple[int, int]]) -> None:
        """The work directory is prepared: `todo` are the chunks still to come, the rest are in place."""
        self.files, self.chunk_bytes = files, chunk_bytes
        missing = set(todo)
        for fi, entry in enumerate(files):
            if entry["name"].endswith(".safetensors") and "delta" not in entry:
                self._have.update((fi, ci) for ci in range(len(entry["chunks"])) if (fi, ci) not in missing)
                self._next[fi] = 0
                self._advance(fi)
        # A file that comes as a delta is ready only once the version is done (see `done`).
        ready = {e["name"]: 0 for e in files if e["name"].endswith(".safetensors")}
        ready.update({files[fi]["name"]: self._ready(fi) for fi in self._next})
        self._state.update(dir=str(work), ready=ready)
        self._write()

    def chunk(self, fi: int, ci: int) -> None:
        """Chunk `ci` of file `fi` is written and matched its hash."""
        if fi not in self._next:
            return
        self._have.add((fi, ci))
        before = self._next[fi]
        self._advance(fi)
        if self._next[fi] != before:
            self._state["ready"][self.files[fi]["name"]] = self._ready(fi)
            self._write()

    def done(self, final: Path) -> None:
        """The version is complete, checked and renamed to `final`."""
        names = sorted(p.name for p in final.glob("*.safetensors"))
        self._state.update(state="done", dir=str(final), ready={n: (final / n).stat().st_size for n in names})
        self._write()

    def fail(self, error: str) -> None:
        self._state.update(state="failed", error=error[:500])
        self._write()

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def _advance(self, fi: int) -> None:
        while (fi, self._next[fi]) in self._have:
            self._next[fi] += 1

    def _ready(self, fi: int) -> int:
        return min(self._next[fi] * self.chunk_bytes, self.files[fi]["size"])

    def _write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self._state))
        os.replace(tmp, self.path)


class _Reader:
    """The worker's view of a progress file: waits until a file's first `n` bytes are in place."""

    def __init__(self, path: str | Path, timeout_s: float):
        self.path, self.timeout_s = Path(path), timeout_s
        self.state: dict[str, Any] = {}
        self.waited_s = 0.0

    def refresh(self) -> None:
        try:
            self.state = json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):  # not written yet (replaced atomically: never half written)
            pass

    def wait(self, name: str | None = None, n: int = 0) -> None:
        started = moved = time.monotonic()
        last = None
        while True:
            self.refresh()
            if self.state.get("state") == "failed":
                raise StreamFailed(f"the fetch failed: {self.state.get('error')}")
            ready = self.state.get("ready", {})
            if self.state and (name is None or ready.get(name, 0) >= n):
                break
            if self.state.get("state") == "done":
                raise StreamFailed(f"the fetched version has no {n} bytes of {name}")
            now = time.monotonic()
            seen = (self.state.get("dir"), sorted(ready.items()))  # any file moving is progress
            if seen != last:
                last, moved = seen, now
            elif now - moved > self.timeout_s:
                raise StreamFailed(f"the fetch made no progress for {self.timeout_s:.0f} s ({self.path})")
            time.sleep(POLL_S)
        self.waited_s += time.monotonic() - started


def streamed_tensors(progress: str | Path, timeout_s: float, info: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Inside an engine worker: every tensor of the version being fetched, each as soon as its bytes are in place
    (in file order), by name. `info` gets the count and the seconds spent waiting for bytes."""
    import torch

    reader = _Reader(progress, timeout_s)
    reader.wait()
    info["tensors"] = 0
    for name in sorted(reader.state["ready"]):
        fd = _open(reader, name)
        try:
            reader.wait(name, 8)
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            reader.wait(name, 8 + n)
            start, header = 8 + n, json.loads(os.pread(fd, n, 8))
            # A private mapping: tensors are views of the page cache, as safetensors' own loader gives them (a
            # copy out of the file took three times as long here). The file keeps its size while the fetch
            # writes it, so no view runs past its end.
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        tensors = sorted((v["data_offsets"], k, v) for k, v in header.items() if k != "__metadata__")
        for (begin, end), key, meta in tensors:
            reader.wait(name, start + end)
            if start + end > len(mapped):
                raise StreamFailed(f"{name} ends before {key}")
            if meta["dtype"] not in DTYPES:
                raise StreamFailed(f"{name}: {key} has dtype {meta['dtype']}, which a fetched version cannot carry")
            dtype = getattr(torch, DTYPES[meta["dtype"]])
            info["tensors"] += 1
            if end == begin:
                yield key, torch.empty(meta["shape"], dtype=dtype)
                continue
            yield key, torch.frombuffer(mapped, dtype=torch.uint8, count=end - begin, offset=start + begin) \
                .view(dtype).reshape(meta["shape"])
    info["stream_wait_s"] = round(reader.waited_s, 3)


def _open(reader: _Reader, name: str) -> int:
    """Open `name` where the progress says the files are. A fetch that completes meanwhile renames its work
    directory: the file is opened again where the progress then says."""
    while True:
        where = reader.state.get("dir")
        try:
            return os.open(Path(where) / name, os.O_RDONLY)
        except FileNotFoundError:
            reader.refresh()
            if reader.state.get("dir") == where:
                reader.wait(name, 1)  # a delta file: it appears (in the final directory) once the version is done
                if reader.state.get("dir") == where:
                    raise

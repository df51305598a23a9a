"""Fetching a published version from a weight server (weights/server.py) into a local directory.

`fetch_version` asks for the manifest (against the version this explorer
holds, if it has its files, so that `.safetensors` files come as deltas),
then pulls every chunk it lacks with a window of requests in flight,
checking each against the manifest's xxh3 (a bad chunk is asked for again).
When no reply comes for `retry_s` it asks again for what is outstanding; the
DEALER socket reconnects by itself after the server restarts or the link
comes back. Chunks land in `.v{N}.partial/` at their offsets, so a fetch
interrupted for good (the explorer restarted) resumes from the chunks already
there: they are hashed and kept. Deltas are applied to the base version's
files, files unchanged since the base are copied from it, and the assembled
version must have the digest the bus announced before it is renamed to
`v{N}/`. A fetch that makes no progress for `timeout_s` raises FetchFailed.

Versions are written over the files of an older one (`retire` keeps the
version before the one held as `.spare/`): overwriting pages the page cache
already holds is a copy, while writing a new file of a few hundred MB makes
the kernel find and zero as many fresh pages, often by reclaiming others
first (0.02-0.03 s against 0.05-0.8 s for 272 MB on this machine). Until an
explorer has fetched two versions there is no older one to write over:
`SpareWarmer` writes a spare of the held version's size in the background, so
that the next fetch already writes over pages the kernel holds.
"""

from __future__ import annotations

import itertools
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import structlog
import zmq

from rlbus.common import protocol as P
from rlbus.weights.checkpoint import version_dirs
from rlbus.weights.delta import apply_delta
from rlbus.weights.digest import Digest, chunk_hashes, matches
from rlbus.weights.server import CHUNK, ERROR, MAGIC, MANIFEST
from rlbus.weights.stream import StreamProgress

log = structlog.get_logger()

SPARE = ".spare"  # an older version's files, written over by the next fetch


class FetchFailed(Exception):
    """A version could not be fetched (server unreachable past the timeout, version gone, bad digest)."""


class DeltaFailed(FetchFailed):
    """The deltas did not give the announced version (a base that is not what it claims): fetch it whole."""


@dataclass
class Fetched:
    path: Path
    version: int
    base: int | None  # the version the deltas were taken against; None for a whole version
    received_bytes: int  # bytes that crossed the network (chunks, including any asked for twice)
    version_bytes: int  # bytes of the version's files
    seconds: float
    bad_chunks: int = 0
    resent: int = 0
    apply_s: float = 0.0  # applying the deltas (decompress, XOR, write)
    manifest_s: float = 0.0  # waiting for the manifest (a server may hold it while it builds a delta)


@dataclass
class Base:
    """A version held locally as files: the base that deltas are taken against."""

    version: int
    path: Path
    digest: str


class _Transfer:
    """One DEALER conversation: requests with ids, resent after silence, replies matched by id."""

    def __init__(self, address: str, server_key: str, client_secret_file: str, retry_s: float, timeout_s: float):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.rcvhwm = 0
        if server_key:
            from rlbus.common.curve import configure_client_keys

            configure_client_keys(self.sock, server_key.encode(), client_secret_file)
        try:
            P.allow_ipv6(self.sock, address)
            self.sock.connect(address)
        except zmq.ZMQError as exc:
            self.sock.close(0)
            raise FetchFailed(f"cannot connect to the weight server at {address!r}: {exc}") from exc
        self.address = address
        self.ids = itertools.count(1)
        self.retry_s, self.timeout_s = retry_s, timeout_s
        self.outstanding: dict[int, tuple[bytes, dict[str, Any], Any]] = {}
        self.progress_at = time.monotonic()
        self.resent = 0

    def send(self, command: bytes, header: dict[str, Any], tag: Any) -> None:
        req = next(self.ids)
        self.outstanding[req] = (command, header, tag)
        try:  # with no connection up (server down, handshake refused) it is asked again after the silence
            self.sock.send_multipart([MAGIC, command, P.pack({"req": req, **header})], zmq.NOBLOCK)
        except zmq.Again:
            pass

    def receive(self) -> tuple[Any, bytes, dict[str, Any], memoryview | None]:
        """The next reply to an outstanding request: (its tag, command, header, data frame)."""
        waited_from = time.monotonic()
        while True:
            if self.sock.poll(int(self.retry_s * 1000)):
                frames = self.sock.recv_multipart(copy=False)  # the chunk is hashed and written from zmq's buffer
                if len(frames) < 3 or frames[0].bytes != MAGIC:
                    continue
                try:
                    header = P.unpack(frames[2].bytes)
                    entry = self.outstanding.pop(header.get("req"), None)
                except Exception:  # not a reply of this protocol: ignored like any stray message
                    continue
                if entry is None:
                    continue  # an answer to a request already asked again
                self.progress_at = time.monotonic()
                return entry[2], frames[1].bytes, header, frames[3].buffer if len(frames) > 3 else None
            now = time.monotonic()
            if now - self.progress_at > self.timeout_s:
                raise FetchFailed(f"no reply from the weight server at {self.address} for {self.timeout_s:.0f} s")
            if now - waited_from >= self.retry_s:  # silence: ask again for everything outstanding
                waited_from = now
                again = list(self.outstanding.values())
                self.outstanding.clear()
                self.resent += len(again)
                for command, header, tag in again:
                    self.send(command, header, tag)

    def close(self) -> None:
        self.sock.close(0)


def _manifest(t: _Transfer, version: int, base: Base | None, delta_wait_s: float | None) -> dict[str, Any]:
    ask = {"version": version}
    if base is not None:
        ask.update(base=base.version, base_digest=base.digest)
        if delta_wait_s is not None:
            ask["delta_wait_ms"] = max(0, round(delta_wait_s * 1000))
    t.send(MANIFEST, ask, None)
    _, command, header, _ = t.receive()
    if command == ERROR:
        raise FetchFailed(f"v{version} from {t.address}: {header.get('code')}: {header.get('message')}")
    return header


def _received_name(entry: dict[str, Any]) -> str:
    """What a manifest entry's chunks are written to: the file itself, or its delta."""
    return entry["name"] + ".zst" if "delta" in entry else entry["name"]


def _recycle(spare: Path, local: Path) -> bool:
    """Move the spare copy of a file to `local` to be written over; False when there is none (or `local` exists)."""
    if local.exists() or not spare.is_file():
        return False
    os.replace(spare, local)
    return True


def retire(dest: str | Path, keep: Path) -> bool:
    """After `keep` is loaded: the newest other version under `dest` becomes the spare, the rest are removed.
    False when there was no other version to keep (the caller may write a spare with `SpareWarmer`)."""
    dest = Path(dest)
    others = [path for _, path in version_dirs(dest) if path != keep]
    if not others:
        return False
    spare = dest / SPARE
    shutil.rmtree(spare, ignore_errors=True)
    os.replace(others.pop(), spare)
    for path in others:
        shutil.rmtree(path, ignore_errors=True)
    return True


class SpareWarmer:
    """Writes `dest/.spare/` with files the size of `like`'s weights files, in the background (see the module
    docstring). Its bytes are never read, only written over: `stop()` may cut it short at any time, and what was
    written serves as far as it goes."""

    BLOCK = 8 << 20

    def __init__(self, dest: str | Path, like: Path):
        self.spare = Path(dest) / SPARE
        self.files = [(p.name, p.stat().st_size) for p in sorted(like.glob("*.safetensors"))]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._write, name="spare-warmer", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        zeros = memoryview(bytes(self.BLOCK))
        try:
            self.spare.mkdir(parents=True, exist_ok=True)
            for name, size in self.files:
                with open(self.spare / name, "wb") as f:
                    for offset in range(0, size, self.BLOCK):
                        if self._stop.is_set():
                            return
                        os.pwrite(f.fileno(), zeros[:size - offset], offset)
        except OSError as exc:  # the directory went away (the explorer stopped, a test cleaned up): no spare then
            log.debug("spare_not_written", error=str(exc))

    def wait(self, timeout: float | None = None) -> bool:
        """True once the spare is written (or given up)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _prepare(files: list[dict[str, Any]], work: Path, base: Base | None, chunk_bytes: int) -> list[tuple[int, int]]:
    """Copy what the base already has, keep chunks a previous attempt left; the (file, chunk) pairs still to get."""
    expected = {_received_name(e) for e in files}
    for stale in work.iterdir():  # left by an attempt against another manifest (whole where this one is a delta)
        if stale.name not in expected:
            stale.unlink()
    todo = []
    for fi, entry in enumerate(files):
        name = entry["name"]
        local = work / _received_name(entry)
        base_file = base.path / name if base is not None else None
        # Files other than weights (config, tokenizer) rarely change: take them from the base when they match.
        if "delta" not in entry and not name.endswith(".safetensors") and base_file is not None and base_file.is_file() \
                and base_file.stat().st_size == entry["size"] and chunk_hashes(base_file, chunk_bytes)[1] == entry["xxh"]:
            shutil.copyfile(base_file, work / name)
            continue
        if "delta" in entry:  # the delta is applied over the spare copy (apply_delta writes in place)
            _recycle(work.parent / SPARE / name, work / name)
            recycled = False
        else:  # an older version's bytes: nothing in it is kept without being fetched
            recycled = _recycle(work.parent / SPARE / name, local)
        size = entry["delta"]["size"] if "delta" in entry else entry["size"]
        have = chunk_hashes(local, chunk_bytes)[0] if not recycled and local.is_file() and local.stat().st_size == size \
            else []
        with open(local, "ab") as f:
            f.truncate(size)
        todo += [(fi, ci) for ci, h in enumerate(entry["chunks"]) if ci >= len(have) or have[ci] != h]
    return todo


class _InOrderDigest:
    """The version's digest (weights/digest.py) taken as its chunks arrive, so that the assembled files need not
    be read again: chunks are hashed in file and offset order, one that arrives early is held until its turn
    (at most `limit` of them), and chunks kept from an earlier attempt are read back from disk at theirs.
    `result()` is None when it could not be taken so (too many chunks early): the files are read again then."""

    def __init__(self, files: list[dict[str, Any]], work: Path, algorithm: str, todo: list[tuple[int, int]],
                 chunk_bytes: int, limit: int = 16):
        self.digest = Digest(algorithm)
        self.files, self.work, self.chunk_bytes, self.limit = files, work, chunk_bytes, limit
        weights = sorted((e["name"], fi) for fi, e in enumerate(files) if e["name"].endswith(".safetensors"))
        self.order = [(fi, ci) for _, fi in weights for ci in range(-1, len(files[fi]["chunks"]))]  # -1: the name
        self.missing = set(todo)
        self.early: dict[tuple[int, int], memoryview] | None = {}
        self.next = 0

    def add(self, fi: int, ci: int, data: memoryview) -> None:
        """Chunk `ci` of file `fi` arrived and matched its hash."""
        self.missing.discard((fi, ci))
        if self.early is None or not self.files[fi]["name"].endswith(".safetensors"):
            return
        self.early[(fi, ci)] = data
        self._advance()
        if len(self.early) > self.limit:
            self.early = None

    def _advance(self) -> None:
        while self.next < len(self.order):
            fi, ci = self.order[self.next]
            if ci < 0:
                self.digest.file(self.files[fi]["name"])
            elif (fi, ci) in self.early:
                self.digest.update(self.early.pop((fi, ci)))
            elif (fi, ci) not in self.missing:  # kept from an earlier attempt
                with open(self.work / self.files[fi]["name"], "rb") as f:
                    self.digest.update(os.pread(f.fileno(), self.chunk_bytes, ci * self.chunk_bytes))
            else:
                break
            self.next += 1

    def result(self) -> str | None:
        if self.early is None:
            return None
        self._advance()  # chunks kept from an earlier attempt, up to the end
        return self.digest.value() if self.next == len(self.order) else None


def fetch_version(address: str, version: int, digest: str, dest: str | Path, base: Base | None = None, *,
                  server_key: str = "", client_secret_file: str = "", timeout_s: float = 120.0,
                  retry_s: float = 2.0, window: int = 4, delta_wait_s: float | None = None,
                  on_chunk: Callable[[int, int], None] | None = None,
                  progress: StreamProgress | None = None) -> Fetched:
    """Fetch version `version` (whose digest the bus announced) into `dest/v{version}/`; see the module docstring.
    With `delta_wait_s` and a `base`, the server sends the whole version if its delta is not built by then.
    With `progress`, what of the weights files is in place is written as it lands, for an engine that reloads
    while the fetch goes on (weights/stream.py); the caller marks it failed if this raises."""
    import xxhash

    started = time.monotonic()
    dest = Path(dest)
    final = dest / f"v{version}"
    if final.is_dir() and matches(final, digest)[0]:
        if progress is not None:
            progress.done(final)
        return Fetched(final, version, None, 0, 0, 0.0)
    if base is not None and not base.path.is_dir():
        base = None
    work = dest / f".v{version}.partial"
    work.mkdir(parents=True, exist_ok=True)
    t = _Transfer(address, server_key, client_secret_file, retry_s, timeout_s)
    try:
        manifest = _manifest(t, version, base, delta_wait_s)
        manifest_s = time.monotonic() - started
        if digest and manifest["digest"] != digest:
            raise FetchFailed(f"the weight server holds v{version} with digest {manifest['digest']}, "
                              f"the bus announced {digest}")
        files, chunk_bytes = manifest["files"], manifest["chunk_bytes"]
        ask = {"version": version}
        if manifest.get("base") is not None:
            ask.update(base=base.version, base_digest=base.digest)
        todo = _prepare(files, work, base, chunk_bytes)
        if progress is not None:
            progress.start(work, files, chunk_bytes, todo)
        # Deltas are hashed as applied files, read again; whole files as their chunks arrive.
        running = None if any("delta" in e for e in files) else \
            _InOrderDigest(files, work, manifest["digest"].partition(":")[0], todo, chunk_bytes)
        total, received, bad = len(todo), 0, 0
        todo.reverse()
        while todo or t.outstanding:
            while todo and len(t.outstanding) < window:
                fi, ci = todo.pop()
                t.send(CHUNK, {**ask, "file": files[fi]["name"], "index": ci}, (fi, ci))
            (fi, ci), command, header, data = t.receive()
            if command == ERROR:
                raise FetchFailed(f"v{version} from {address}: {header.get('code')}: {header.get('message')}")
            received += len(data) if data is not None else 0
            if data is None or xxhash.xxh3_64_intdigest(data) != files[fi]["chunks"][ci]:
                bad += 1
                log.warning("weights_chunk_refused", policy_version=version, file=files[fi]["name"], chunk=ci)
                todo.append((fi, ci))
                continue
            with open(work / _received_name(files[fi]), "r+b") as f:
                os.pwrite(f.fileno(), data, ci * chunk_bytes)
            if running is not None:
                running.add(fi, ci, data)
            if progress is not None:
                progress.chunk(fi, ci)
            if on_chunk is not None:
                on_chunk(total - len(todo) - len(t.outstanding), total)
    finally:
        t.close()
    applying = time.monotonic()
    for entry in files:
        if "delta" in entry:
            blob = work / _received_name(entry)
            try:
                apply_delta(base.path / entry["name"], blob, work / entry["name"])
            except (ValueError, OSError) as exc:  # zstd errors are ValueErrors too
                shutil.rmtree(work, ignore_errors=True)
                raise DeltaFailed(f"the delta for {entry['name']} does not apply to v{base.version}: {exc}") from exc
            blob.unlink()
    apply_s = time.monotonic() - applying
    actual = running.result() if running is not None else None
    ok, actual = (actual == manifest["digest"], actual) if actual is not None else matches(work, manifest["digest"])
    if not ok:
        shutil.rmtree(work, ignore_errors=True)
        failure = DeltaFailed if manifest.get("base") is not None else FetchFailed
        raise failure(f"v{version} assembled from {address} has digest {actual}, expected {manifest['digest']}")
    # Not fsynced: a copy torn by a crash fails its digest when it is next used, and is fetched again.
    shutil.rmtree(final, ignore_errors=True)
    os.rename(work, final)
    if progress is not None:
        progress.done(final)
    return Fetched(final, version, manifest.get("base"), received, sum(f["size"] for f in files),
                   time.monotonic() - started, bad, t.resent, apply_s, manifest_s)

"""What the weight server serves: the manifest of each published version, whole or as deltas.

A manifest lists a version's files with the xxh3 of every chunk of what is
sent for each (docs/protocol.md, *Weight server*). Whole manifests only
hash files: they are made on the publisher's thread as a version is added
(`add`, which needs the digest anyway), or on a scanner thread. Deltas
(weights/delta.py: zstd of base XOR version) are built once per (base,
version) pair, each file's in a child process that runs at idle priority by
default (Linux's SCHED_IDLE): it takes only CPU that training leaves, so a
delta does not slow a step. Not in a thread of the trainer's: a starved
thread that asks for the GIL holds up the thread that drops it (CPython
makes that one wait until another has taken it), so an idle-priority thread
would stall training on a host whose cores are busy; and it could hold the
trainer's exit as long as it is starved, where a child is killed. Deltas are
kept under `.deltas/` beside the versions and dropped with them. Once a
client has asked for a delta, `add` starts the build of each new version's
delta from the one before, so a client that asks once the version is
announced finds it ready when there was CPU to spare; not while two builds
wait (`backlog`), so a trainer that leaves no CPU does not pile them up.
Nor while builds come too late: once the deltas of `LATE` versions in a row
were not ready for any client that asked in time (each got the whole
version), a delta is built for one version in `PROBE_EVERY` only, ahead or
asked for, until one comes in time. An idle-priority build still takes
caches, memory bandwidth and the CPU of the moments training waits: on a
two-core host it cost a trainer on one core about 5% of its step, for
deltas no client took (benchmarks/trainer.py --serve).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog

from rlbus.weights.checkpoint import version_dirs
from rlbus.weights.digest import chunk_hashes, scan_version, weights_digest

log = structlog.get_logger()

DELTAS = ".deltas"
LATE = 2  # versions in a row whose delta no client took in time: from then on, builds are tried now and then
PROBE_EVERY = 8  # while builds are late: one version in this many gets a delta built


class Gone(Exception):
    """The version (or its base) is not held here (never published, or pruned)."""


def delta_command(base: Path, target: Path, out: Path, idle: bool) -> list[str]:
    flags = ["--idle"] if idle else []
    return [sys.executable, "-m", "rlbus.weights.delta", *flags, str(base), str(target), str(out)]


class Manifests:
    """The manifests of the versions under `weights_dir`, built on demand and remembered (the last 32)."""

    def __init__(self, weights_dir: str | Path, chunk_bytes: int, deltas: bool = True, delta_priority: str = "idle"):
        if delta_priority not in ("idle", "normal"):
            raise ValueError(f"delta_priority is idle or normal, not {delta_priority!r}")
        self.dir = Path(weights_dir)
        self.chunk_bytes = chunk_bytes
        self.deltas = deltas  # off: every version is served whole
        self.delta_asked = False  # whether clients have asked for deltas: `add` builds them ahead then
        self.idle = delta_priority == "idle"  # deltas (XOR, zstd) on CPU that training leaves
        self._scanner = ThreadPoolExecutor(1, thread_name_prefix="weights-scanner")  # whole manifests
        self._builder = ThreadPoolExecutor(1, thread_name_prefix="weights-builder")  # delta manifests
        self._child: subprocess.Popen | None = None  # the process building a delta, if one is
        self._closed = False
        self._manifests: dict[tuple, Future] = {}
        self._lock = threading.Lock()  # the serving thread and the publishing thread (`add`)
        self._digests: dict[tuple[int, tuple[int, int] | None], str] = {}
        self.cpu_s = 0.0  # CPU time spent hashing and building
        self.backlog = 0  # delta builds submitted and not finished: more than one, and the builder is behind
        self.late = 0  # versions in a row whose delta came too late for every client that asked (`missed`)
        self._missed = self._tried = -1  # the last version that `missed` counted, the last one tried while late
        self._counting = threading.Lock()  # not `_lock`: a build done at once runs `_built` under `_lock`

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._child is not None:
                self._child.kill()  # a build starved at idle priority does not hold the trainer's exit
        self._builder.shutdown(wait=False, cancel_futures=True)
        self._scanner.shutdown(wait=False, cancel_futures=True)

    def _make_delta(self, base: Path, target: Path, out: Path) -> tuple[int | None, bool]:
        """`delta.make_delta` in a child process (see the module docstring): the delta's size (None: no delta), and
        whether the child ran at idle priority."""
        argv = delta_command(base, target, out, self.idle)
        with self._lock:
            if self._closed:
                raise Gone("the weight server is closing")
            self._child = child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            printed, errors = child.communicate()
        finally:
            with self._lock:
                self._child = None
        if child.returncode != 0:
            raise RuntimeError(f"building the delta of {target} failed (exit {child.returncode}): {errors[-500:]}")
        reply = json.loads(printed)
        self.cpu_s += reply["cpu_s"]
        return reply["size"], reply["idle"]

    def add(self, version: int, previous: tuple[int, str] | None) -> str:
        """`version` is written under the served directory: take its digest and its whole manifest in one read
        (on the caller's thread: the publisher's, which needs the digest anyway), and start building the delta
        from `previous` (the version published before it, and its digest) if clients have taken deltas. An
        explorer that asks once the version is announced finds its manifest ready instead of waiting for the
        build (a delta of the default model: about 0.5 s). Returns the digest."""
        cpu = time.thread_time()
        whole = self._scan(version)
        self.cpu_s += time.thread_time() - cpu
        made: Future = Future()
        made.set_result(whole)
        with self._lock:
            self._remember((version, self._stamp(version), None, ""), made)
        if self.delta_asked and previous is not None and self.backlog < 2 and self.worth_building(version):
            self.get(version, *previous)  # (a builder behind gets no more)
        return whole["digest"]

    def worth_building(self, version: int) -> bool:
        """Whether to build a delta of `version`: while builds come in time, always; once `LATE` in a row came too
        late, for one version in `PROBE_EVERY` (to see whether there is CPU again)."""
        if self.late < LATE:
            return True
        if version < self._tried + PROBE_EVERY:
            return False
        self._tried = version
        return True

    def missed(self, version: int) -> None:
        """A client was given the whole `version` because its delta was not built in time."""
        if version != self._missed:
            self._missed, self.late = version, self.late + 1
            if self.late == LATE:
                self._tried = version
                log.info("weights_deltas_paused", policy_version=version, late=LATE, probe_every=PROBE_EVERY,
                         reason="deltas not built in time for any client: no CPU to spare")

    def taken(self) -> None:
        """A client was given a delta manifest: builds come in time."""
        if self.late >= LATE:
            log.info("weights_deltas_resumed")
        self.late = 0

    def building(self, version: int, base: int, base_digest: str) -> bool:
        """Whether the delta of `version` from `base` is built or being built."""
        with self._lock:
            return (version, self._stamp(version), base, base_digest) in self._manifests

    def get(self, version: int, base: int | None, base_digest: str) -> Future:
        """The manifest of `version` as a delta from `base` when one can be made, else whole; built once."""
        if base is not None and (base >= version or not base_digest or not self.deltas):
            base = None
        if base is not None and self._digests.get((base, self._stamp(base)), base_digest) != base_digest:
            base = None  # a base this server holds other bytes for: the whole version, under one key for all such
        # A version directory replaced under the same number (a restarted trainer) gets a new manifest.
        key = (version, self._stamp(version), base, base_digest if base is not None else "")
        with self._lock:
            future = self._manifests.get(key)
            if future is None or (future.done() and future.exception() is not None):
                if base is None:
                    future = self._scanner.submit(self._build, version, base, base_digest)
                else:
                    with self._counting:
                        self.backlog += 1
                    future = self._builder.submit(self._build, version, base, base_digest)
                    future.add_done_callback(self._built)
                self._remember(key, future)
        return future

    def _built(self, _: Future) -> None:
        with self._counting:
            self.backlog -= 1

    def _remember(self, key: tuple, future: Future) -> None:
        self._manifests[key] = future
        if len(self._manifests) > 32:
            self._manifests.pop(next(iter(self._manifests)))

    def _version_dir(self, version: int) -> Path:
        path = self.dir / f"v{version}"
        if not path.is_dir():
            raise Gone(f"v{version} is not held here (held: {self.held()})")
        return path

    def held(self) -> list[int]:
        return [version for version, _ in version_dirs(self.dir)]

    def _stamp(self, version: int) -> tuple[int, int] | None:
        try:
            st = (self.dir / f"v{version}").stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns

    def _digest(self, version: int) -> str:
        key = (version, self._stamp(version))
        if key not in self._digests:
            self._digests[key] = weights_digest(self._version_dir(version))
        return self._digests[key]

    def _scan(self, version: int) -> dict[str, Any]:
        """The manifest of `version` served whole, and its digest remembered, from one read of its files."""
        started = time.monotonic()
        digest, files = scan_version(self._version_dir(version), self.chunk_bytes)
        self._digests[(version, self._stamp(version))] = digest
        log.info("weights_manifest_built", policy_version=version, base=None, files=len(files), deltas=0,
                 seconds=round(time.monotonic() - started, 3))
        return {"version": version, "digest": digest, "chunk_bytes": self.chunk_bytes, "base": None, "files": files}

    def _build(self, version: int, base: int | None, base_digest: str) -> dict[str, Any]:
        cpu = time.thread_time()
        try:
            return self._build_manifest(version, base, base_digest)
        finally:
            self.cpu_s += time.thread_time() - cpu

    def _build_manifest(self, version: int, base: int | None, base_digest: str) -> dict[str, Any]:
        started = time.monotonic()
        target = self._version_dir(version)
        base_dir = None
        if base is not None:
            try:
                if self._digest(base) == base_digest:
                    base_dir = self._version_dir(base)
            except Gone:
                pass
        if base_dir is None:
            return self._scan(version)
        files, deltas, known, idle = [], 0, self._whole_hashes(version), []
        for path in sorted(p for p in target.iterdir() if p.is_file() and not p.name.startswith(".")):
            source, delta = path, None
            if path.suffix == ".safetensors" and (base_dir / path.name).is_file():
                pair = f"v{base}-v{version}.{base_digest[-12:]}{self._digest(version)[-12:]}"
                blob = self.dir / DELTAS / pair / f"{path.name}.zst"
                blob.parent.mkdir(parents=True, exist_ok=True)
                if not blob.exists():  # else built for an earlier request; none is written when none is worth it
                    idle.append(self._make_delta(base_dir / path.name, path, blob)[1])
                if blob.exists():
                    source, delta = blob, {"base": base, "size": blob.stat().st_size}
                    deltas += 1
            hashes, whole = chunk_hashes(source, self.chunk_bytes)
            if delta is not None:
                whole = known.get(path.name) or chunk_hashes(path, self.chunk_bytes)[1]
            entry = {"name": path.name, "size": path.stat().st_size, "xxh": whole, "chunks": hashes,
                     "source": str(source)}
            if delta is not None:
                entry["delta"] = delta
            files.append(entry)
        self._prune_deltas()
        log.info("weights_manifest_built", policy_version=version, base=base if deltas else None,
                 files=len(files), deltas=deltas, seconds=round(time.monotonic() - started, 3),
                 built=len(idle), idle=bool(idle) and all(idle))
        return {"version": version, "digest": self._digest(version), "chunk_bytes": self.chunk_bytes,
                "base": base if deltas else None, "files": files}

    def _whole_hashes(self, version: int) -> dict[str, str]:
        """The xxh3 of each file of `version`, from its whole manifest when that is built (`add` builds it)."""
        with self._lock:
            future = self._manifests.get((version, self._stamp(version), None, ""))
        if future is None or not future.done() or future.exception() is not None:
            return {}
        return {entry["name"]: entry["xxh"] for entry in future.result()["files"]}

    def _prune_deltas(self) -> None:
        held = set(self.held())
        for key in list(self._digests):
            if key[0] not in held:
                del self._digests[key]
        for pair in (self.dir / DELTAS).glob("v*-v*"):
            a, _, b = pair.name.split(".")[0].partition("-")
            if not (a[1:].isdigit() and b[1:].isdigit() and int(a[1:]) in held and int(b[1:]) in held):
                shutil.rmtree(pair, ignore_errors=True)

"""The weight server: published versions over ZeroMQ, in checked chunks, whole or as deltas.

The trainer runs one in a thread beside training (`sync.serve`, on by
default) over the directory its checkpoint sender writes, and announces its
address on the weight-version bus (`fetch_from`). Weight bytes never pass
through the broker: the broker carries the announcement, the server the
bytes. It runs in the trainer, not in a process of its own, because the
trainer is the one place that holds every published version anyway, and
because its work releases the GIL (file reads, hashing, XOR in numpy, zstd,
sends); `python -m rlbus.weights.server DIR` serves a directory on its own,
for a storage host that receives copies of the versions.

The protocol (docs/protocol.md, *Weight server*): a DEALER asks
`MANIFEST {req, version, base?, base_digest?}` and gets the list of files
with the xxh3 of every chunk; with a base the server still holds (same
digest), `.safetensors` files come as deltas (weights/delta.py), built once
per (base, version) pair on a builder thread and kept beside the versions.
`CHUNK {req, version, base?, file, index}` gets one chunk as a raw frame.
Requests name versions and files of the manifest, never paths, so a client
reads nothing but published versions. Replies that need a manifest not yet
built wait for the builder; everything else is answered at once.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import structlog
import zmq

from rlbus.common import protocol as P
from rlbus.weights.checkpoint import version_dirs
from rlbus.weights.delta import make_delta
from rlbus.weights.digest import chunk_hashes, scan_version, weights_digest

log = structlog.get_logger()

MAGIC = b"rlbus-weights/1"
MANIFEST, CHUNK, ERROR = b"MANIFEST", b"CHUNK", b"ERROR"
MAX_REQUEST_BYTES = 64 << 10
MAX_WAITING = 4096  # requests held while their manifest is built
DELTAS = ".deltas"


class Request(msgspec.Struct, forbid_unknown_fields=False):
    req: int
    version: int
    base: int | None = None
    base_digest: str = ""
    file: str = ""
    index: int = 0


class Gone(Exception):
    """The version (or its base) is not held here (never published, or pruned)."""


def advertised(bind_host: str, advertise: str, port: int) -> str:
    host = advertise or (socket.gethostname() if bind_host in ("0.0.0.0", "*", "") else bind_host)
    return f"tcp://{host}:{port}"


class WeightServer:
    def __init__(self, weights_dir: str | Path, host: str = "127.0.0.1", port: int = 0, advertise: str = "",
                 chunk_bytes: int = 4 << 20, curve: tuple[str, str] | None = None, deltas: bool = True):
        self.dir = Path(weights_dir)
        self.deltas = deltas  # off: every version is served whole
        self.dir.mkdir(parents=True, exist_ok=True)
        self.chunk_bytes = chunk_bytes
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.maxmsgsize = MAX_REQUEST_BYTES
        self.sock.sndhwm = 16  # chunk replies queued per client: a client that stops reading holds 64 MB at most
        self.auth = None
        self.public_key = ""
        if curve:  # (this host's secret key file, directory of admitted client keys)
            from zmq.auth import load_certificate

            from rlbus.common.curve import load_server_auth

            self.auth = load_server_auth(self.ctx, curve[0], curve[1], [self.sock])
            self.public_key = load_certificate(curve[0])[0].decode()
        bind_host = "*" if host in ("0.0.0.0", "*", "") else host
        try:
            if port:
                self.sock.bind(f"tcp://{bind_host}:{port}")
            else:
                port = self.sock.bind_to_random_port(f"tcp://{bind_host}")
        except zmq.ZMQError as exc:
            if self.auth is not None:
                self.auth.stop()
            self.sock.close(0)
            self.ctx.term()
            raise OSError(f"the weight server cannot listen on {host}:{port or 'a free port'} "
                          f"(sync.serve_host, sync.serve_port): {exc}") from exc
        self.address = advertised(host, advertise, port)
        self._builder = ThreadPoolExecutor(1, thread_name_prefix="weights-builder")
        self._manifests: dict[tuple, Future] = {}
        self._manifests_lock = threading.Lock()  # the serving thread and the publishing thread (`add`)
        self._delta_asked = False  # whether clients have asked for deltas: `add` builds them ahead then
        self._digests: dict[tuple[int, tuple[int, int] | None], str] = {}
        self._waiting: list[tuple[Future, bytes, bytes, Request]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.served_bytes = 0
        self._serve_cpu = self._build_cpu = 0.0  # each thread adds to its own

    @property
    def cpu_s(self) -> float:
        """CPU time of the serving and builder threads: what serving takes from the trainer."""
        return self._serve_cpu + self._build_cpu

    # ---- lifecycle ----------------------------------------------------------

    def start(self) -> "WeightServer":
        self._thread = threading.Thread(target=self.serve, name="weight-server", daemon=True)
        self._thread.start()
        log.info("weight_server_started", address=self.address, curve=bool(self.auth), dir=str(self.dir))
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._builder.shutdown(wait=False, cancel_futures=True)
        if self.auth is not None:
            self.auth.stop()
        self.sock.close(0)
        self.ctx.term()

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        last = time.thread_time()
        while not self._stop.is_set():
            now = time.thread_time()
            self._serve_cpu, last = self._serve_cpu + now - last, now
            if poller.poll(20 if self._waiting else 200):
                for _ in range(64):
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        self._on_request([f.bytes for f in frames[:5]])
                    except Exception:  # a bug or an unreadable file costs one request, never the server
                        log.exception("weights_request_failed")
            try:
                self._answer_ready()
            except Exception:
                log.exception("weights_request_failed")
                self._waiting = [w for w in self._waiting if not w[0].done()]

    # ---- requests -------------------------------------------------------------

    def _on_request(self, frames: list[bytes]) -> None:
        if len(frames) != 4 or frames[1] != MAGIC:
            self._error(frames[0], None, "bad_request", f"expected [{MAGIC.decode()}, command, header]")
            return
        ident, _, command, header = frames
        try:
            request = msgspec.msgpack.decode(header, type=Request)
        except msgspec.DecodeError as exc:
            self._error(ident, None, "bad_request", f"bad header: {exc}")
            return
        if command not in (MANIFEST, CHUNK):
            self._error(ident, request.req, "bad_request", f"unknown command {P.brief(command)}")
            return
        if request.version < 0 or (request.base is not None and request.base < 0):
            self._error(ident, request.req, "bad_request", "versions are not negative")
            return
        if len(self._waiting) >= MAX_WAITING:
            self._error(ident, request.req, "busy", "too many requests wait for a manifest; ask again later")
            return
        if command == MANIFEST:
            self._delta_asked |= request.base is not None and self.deltas
        future = self._manifest(request.version, request.base, request.base_digest)
        self._waiting.append((future, ident, command, request))

    def add(self, version: int, previous: tuple[int, str] | None) -> str:
        """`version` is written under the served directory: take its digest and its whole manifest in one read
        (on the caller's thread: the publisher's, which needs the digest anyway), and start building the delta
        from `previous` (the version published before it, and its digest) if clients have taken deltas. An
        explorer that asks once the version is announced finds its manifest ready instead of waiting for the
        build (a delta of the default model: about 0.5 s). Returns the digest."""
        cpu = time.thread_time()
        whole = self._scan(version)
        self._build_cpu += time.thread_time() - cpu
        made: Future = Future()
        made.set_result(whole)
        with self._manifests_lock:
            self._remember((version, self._stamp(version), None, ""), made)
        if self._delta_asked and previous is not None:
            self._manifest(version, *previous)
        return whole["digest"]

    def _answer_ready(self) -> None:
        still = []
        for future, ident, command, request in self._waiting:
            if not future.done():
                still.append((future, ident, command, request))
                continue
            exc = future.exception()
            if exc is not None:
                code = "gone" if isinstance(exc, Gone) else "internal"
                self._error(ident, request.req, code, str(exc))
            elif command == MANIFEST:
                self._send(ident, MANIFEST, {"req": request.req, **future.result()})
            else:
                self._chunk(ident, request, future.result())
        self._waiting = still

    def _chunk(self, ident: bytes, request: Request, manifest: dict[str, Any]) -> None:
        entry = next((f for f in manifest["files"] if f["name"] == request.file), None)
        if entry is None:
            self._error(ident, request.req, "bad_request", f"v{request.version} has no file {P.brief(request.file)}")
            return
        if not 0 <= request.index < len(entry["chunks"]):
            self._error(ident, request.req, "bad_request", f"{request.file} has {len(entry['chunks'])} chunks")
            return
        path = Path(entry["source"])
        try:
            with open(path, "rb") as f:
                data = os.pread(f.fileno(), self.chunk_bytes, request.index * self.chunk_bytes)
        except FileNotFoundError:
            self._error(ident, request.req, "gone", f"v{request.version} is no longer held")
            return
        self.served_bytes += len(data)
        self.sock.send_multipart([ident, MAGIC, CHUNK, P.pack({"req": request.req, "file": request.file,
                                                               "index": request.index}), data], copy=False)

    def _send(self, ident: bytes, command: bytes, header: dict[str, Any]) -> None:
        public = dict(header)
        if "files" in public:
            public["files"] = [{k: v for k, v in f.items() if k != "source"} for f in public["files"]]
        self.sock.send_multipart([ident, MAGIC, command, P.pack(public)])

    def _error(self, ident: bytes, req: int | None, code: str, message: str) -> None:
        self.sock.send_multipart([ident, MAGIC, ERROR, P.pack({"req": req, "code": code, "message": message})])

    # ---- manifests and deltas (builder thread) -----------------------------------

    def _manifest(self, version: int, base: int | None, base_digest: str) -> Future:
        if base is not None and (base >= version or not base_digest or not self.deltas):
            base = None
        if base is not None and self._digests.get((base, self._stamp(base)), base_digest) != base_digest:
            base = None  # a base this server holds other bytes for: the whole version, under one key for all such
        # A version directory replaced under the same number (a restarted trainer) gets a new manifest.
        key = (version, self._stamp(version), base, base_digest if base is not None else "")
        with self._manifests_lock:
            future = self._manifests.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._builder.submit(self._build, version, base, base_digest)
                self._remember(key, future)
        return future

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
            self._build_cpu += time.thread_time() - cpu

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
        files, deltas = [], 0
        for path in sorted(p for p in target.iterdir() if p.is_file() and not p.name.startswith(".")):
            source, delta = path, None
            if path.suffix == ".safetensors" and (base_dir / path.name).is_file():
                pair = f"v{base}-v{version}.{base_digest[-12:]}{self._digest(version)[-12:]}"
                blob = self.dir / DELTAS / pair / f"{path.name}.zst"
                blob.parent.mkdir(parents=True, exist_ok=True)
                if blob.exists() or make_delta(base_dir / path.name, path, blob) is not None:
                    source, delta = blob, {"base": base, "size": blob.stat().st_size}
                    deltas += 1
            hashes, whole = chunk_hashes(source, self.chunk_bytes)
            if delta is not None:
                whole = chunk_hashes(path, self.chunk_bytes)[1]
            entry = {"name": path.name, "size": path.stat().st_size, "xxh": whole, "chunks": hashes,
                     "source": str(source)}
            if delta is not None:
                entry["delta"] = delta
            files.append(entry)
        self._prune_deltas()
        log.info("weights_manifest_built", policy_version=version, base=base if deltas else None,
                 files=len(files), deltas=deltas, seconds=round(time.monotonic() - started, 3))
        return {"version": version, "digest": self._digest(version), "chunk_bytes": self.chunk_bytes,
                "base": base if deltas else None, "files": files}

    def _prune_deltas(self) -> None:
        held = set(self.held())
        for key in list(self._digests):
            if key[0] not in held:
                del self._digests[key]
        for pair in (self.dir / DELTAS).glob("v*-v*"):
            a, _, b = pair.name.split(".")[0].partition("-")
            if not (a[1:].isdigit() and b[1:].isdigit() and int(a[1:]) in held and int(b[1:]) in held):
                shutil.rmtree(pair, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    """Serve a directory of published versions (v1/, v2/, ...) on its own, until SIGINT or SIGTERM."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(prog="python -m rlbus.weights.server", description=main.__doc__)
    parser.add_argument("dir", help="the directory holding the published versions v1/, v2/, ...")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0: all)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (0: a free one)")
    parser.add_argument("--chunk-mb", type=float, default=4.0, help="chunk size in MB")
    args = parser.parse_args(argv)
    from rlbus.common.logging import setup_logging

    setup_logging("weight-server")
    server = WeightServer(args.dir, args.host, args.port, chunk_bytes=int(args.chunk_mb * (1 << 20)))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(server.address, flush=True)
    # Python runs a signal's handler in the main thread, and a signal the kernel hands to one of the server's
    # threads does not wake a main thread blocked without a timeout: it would never stop (seen 2 times in 30).
    while not stop.wait(0.5):
        pass
    server.close()


if __name__ == "__main__":
    main()

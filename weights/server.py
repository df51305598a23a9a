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
`MANIFEST {req, version, base?, base_digest?, delta_wait_ms?}` and gets
the list of files with the xxh3 of every chunk; with a base the server still
holds (same digest), `.safetensors` files come as deltas (weights/delta.py),
built once per (base, version) pair in a child process at idle priority
(weights/manifests.py).
A MANIFEST for a delta waits for its build at most `delta_wait_ms` (the
receiver sends the time its last whole version took; 10 s when a client
does not say), then gets the whole version; at once when the builder is
behind (other builds queued before it: no CPU to spare). Waiting at most
what the alternative costs bounds a client's loss to twice a whole fetch; a
trainer with spare CPU (on GPUs, or between rollouts) has the delta ready
sooner.
`CHUNK {req, version, base?, file, index}` gets one chunk as a raw frame.
Requests name versions and files of the manifest, never paths, so a client
reads nothing but published versions. Replies that need a manifest not yet
built wait for it; everything else is answered at once.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgspec
import structlog
import zmq

from rlbus.common import protocol as P
from rlbus.common.messages import Int
from rlbus.weights.manifests import Gone, Manifests
from rlbus.weights.replies import Replies

log = structlog.get_logger()

MAGIC = b"rlbus-weights/1"
MANIFEST, CHUNK, ERROR = b"MANIFEST", b"CHUNK", b"ERROR"
MAX_REQUEST_BYTES = 64 << 10  # a larger request is answered `bad_request`
MAX_FRAME_BYTES = 1 << 20  # a larger frame drops the connection (ZMQ_MAXMSGSIZE): guards memory only
MAX_WAITING = 4096  # requests held while their manifest is built
DELTA_WAIT_S = 10.0  # how long a MANIFEST for a delta waits for its build when the client does not say


class Request(msgspec.Struct, forbid_unknown_fields=False):
    req: Int  # integers are unsigned, as in the broker's protocol: a negative one is `bad_request`
    version: Int
    base: Int | None = None
    base_digest: str = ""
    file: str | msgspec.UnsetType = msgspec.UNSET  # CHUNK's, which must name both
    index: Int | msgspec.UnsetType = msgspec.UNSET
    delta_wait_ms: Int | None = None  # MANIFEST with a base: after this long, the whole version if no delta yet


def advertised(bind_host: str, advertise: str, port: int) -> str:
    return P.tcp(advertise or (socket.gethostname() if bind_host in P.EVERY_INTERFACE else bind_host), port)


class WeightServer:
    def __init__(self, weights_dir: str | Path, host: str = "127.0.0.1", port: int = 0, advertise: str = "",
                 chunk_bytes: int = 4 << 20, curve: tuple[str, str] | None = None, deltas: bool = True,
                 delta_priority: str = "idle", map_files: bool = False, await_s: float = 0.0,
                 settings: str = "sync.serve_host, sync.serve_port"):
        """`map_files`: send chunks as views of the files mapped into memory (`FileMaps`); only for a directory
        whose files are replaced by rename or deleted, never rewritten in place, as the trainer's own.
        `await_s`: a request for a version newer than any held waits this long for it to arrive (a mirror's
        versions arrive after the bus announced them, weights/mirror.py), then is answered `gone`. `settings`: what
        sets host and port, for the error when they cannot be bound."""
        self.dir = Path(weights_dir)
        self.await_s = await_s
        self._awaiting: list[tuple[float, int, list[bytes]]] = []  # (until when, version, request) not here yet
        self._maps = FileMaps() if map_files else None
        self.dir.mkdir(parents=True, exist_ok=True)
        self.chunk_bytes = chunk_bytes
        self.manifests = Manifests(self.dir, chunk_bytes, deltas, delta_priority)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.maxmsgsize = MAX_FRAME_BYTES
        self.sock.sndhwm = 16  # chunk replies queued per client: a client that stops reading holds 64 MB at most
        self.out = Replies(self.sock)  # replies the queue refuses wait there (weights/replies.py)
        self.auth = None
        self.public_key = ""
        if curve:  # (this host's secret key file, directory of admitted client keys)
            from zmq.auth import load_certificate

            from rlbus.common.curve import load_server_auth

            self.auth = load_server_auth(self.ctx, curve[0], curve[1], [self.sock], (
                "broker.curve_client_key", "sync.serve_authorized_dir (default: broker.curve_authorized_dir)"))
            self.public_key = load_certificate(curve[0])[0].decode()
        bind_host = "*" if host in ("0.0.0.0", "*", "") else host  # "::" stays: both families
        try:
            port = P.bind_tcp(self.sock, bind_host, port)
        except zmq.ZMQError as exc:
            if self.auth is not None:
                self.auth.stop()
            self.sock.close(0)
            self.ctx.term()
            raise OSError(f"the weight server cannot listen on {P.tcp(bind_host, port or '*')} ({settings}): "
                          f"{exc}") from exc
        self.address = advertised(host, advertise, port)
        # (manifest, client, command, request, patience): patience is (when a delta's wait ends, the wait), or None
        self._waiting: list[tuple[Future, bytes, bytes, Request, tuple[float, float] | None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.served_bytes = 0
        self._serve_cpu = 0.0

    @property
    def cpu_s(self) -> float:
        """CPU time of the serving and builder threads: what serving takes from the trainer."""
        return self._serve_cpu + self.manifests.cpu_s

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
        self.manifests.close()
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
            if poller.poll(5 if self.out.pending else 20 if self._waiting or self._awaiting else 200):
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
                self.out.flush()  # after the poll: the socket has taken note of what its clients read
                self._arrived()
                self._answer_ready()
            except Exception:
                log.exception("weights_request_failed")
                self._waiting = [w for w in self._waiting if not w[0].done()]

    # ---- requests -------------------------------------------------------------

    def _on_request(self, frames: list[bytes], waited: bool = False) -> None:
        # A refused request's `req` is answered wherever its header can be read (of another tag, or too large)
        if len(frames) != 4 or frames[1] != MAGIC:
            req = P.request_id(frames[3]) if len(frames) == 4 else None
            self._error(frames[0], req, "bad_request", f"expected [{MAGIC.decode()}, command, header]")
            return
        ident, _, command, header = frames
        if len(header) > MAX_REQUEST_BYTES:
            self._error(ident, P.request_id(header), "bad_request",
                        f"a request header of {len(header)} bytes; at most {MAX_REQUEST_BYTES}")
            return
        try:
            request = msgspec.msgpack.decode(header, type=Request)
        except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: an unnamed field nested too deep
            self._error(ident, P.request_id(header), "bad_request", f"bad header: {exc}")
            return
        if command not in (MANIFEST, CHUNK):
            self._error(ident, request.req, "bad_request", f"unknown command {P.brief(command)}")
            return
        if command == CHUNK and msgspec.UNSET in (request.file, request.index):
            self._error(ident, request.req, "bad_request", "a CHUNK names its file and index")
            return
        if len(self._waiting) + len(self._awaiting) >= MAX_WAITING:
            self._error(ident, request.req, "busy", "too many requests wait for a manifest; ask again later")
            return
        if self.await_s and not waited and self._newer_than_held(request.version):
            self._awaiting.append((time.monotonic() + self.await_s, request.version, frames))
            return
        patience = None
        if command == MANIFEST:
            self.manifests.delta_asked |= request.base is not None and self.manifests.deltas
            if request.base is not None and not self.manifests.building(request.version, request.base,
                                                                        request.base_digest) \
                    and not self.manifests.worth_building(request.version):
                request.base = None  # builds come too late here (`Manifests.missed`): the whole version at once
        future = self.manifests.get(request.version, request.base, request.base_digest)
        if command == MANIFEST and request.base is not None:
            # A builder with more than this build to do is not keeping up (no CPU to spare): the whole at once.
            wait = DELTA_WAIT_S if request.delta_wait_ms is None else request.delta_wait_ms / 1000
            wait = wait if self.manifests.backlog <= 1 else 0.0
            patience = (time.monotonic() + wait, wait)
        self._waiting.append((future, ident, command, request, patience))

    def _newer_than_held(self, version: int, newest: int | None = None) -> bool:
        newest = max(self.held(), default=0) if newest is None else newest
        return not (self.dir / f"v{version}").is_dir() and version > newest

    def _arrived(self) -> None:
        """Requests that waited for a version: taken up once it is here, or once their wait is over (`gone`)."""
        if self._awaiting:
            now, newest, awaiting, self._awaiting = time.monotonic(), max(self.held(), default=0), self._awaiting, []
            for until, version, frames in awaiting:
                if until > now and self._newer_than_held(version, newest):
                    self._awaiting.append((until, version, frames))
                    continue
                try:
                    self._on_request(frames, waited=True)
                except Exception:  # as in `serve`: one request, never the others
                    log.exception("weights_request_failed")

    def add(self, version: int, previous: tuple[int, str] | None) -> str:
        """A version is written under the served directory; its digest (`Manifests.add`)."""
        return self.manifests.add(version, previous)

    def held(self) -> list[int]:
        return self.manifests.held()

    def _answer_ready(self) -> None:
        still = []
        for future, ident, command, request, patience in self._waiting:
            if not future.done() and patience is not None and time.monotonic() >= patience[0]:
                # The delta is not built within what the client would wait: the whole version (its manifest
                # names no base, so the client asks for whole chunks); the delta goes on for later clients.
                log.info("weights_delta_not_ready", policy_version=request.version, base=request.base,
                         waited_s=patience[1], backlog=self.manifests.backlog)
                self.manifests.missed(request.version)
                future, patience = self.manifests.get(request.version, None, ""), None
            if not future.done():
                still.append((future, ident, command, request, patience))
                continue
            exc = future.exception()
            if exc is not None:
                code = "gone" if isinstance(exc, Gone) else "internal"
                self._error(ident, request.req, code, str(exc))
            elif command == MANIFEST:
                manifest = future.result()
                if manifest["base"] is not None:
                    self.manifests.taken()
                self._send(ident, MANIFEST, {"req": request.req, **manifest})
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
        path, start = Path(entry["source"]), request.index * self.chunk_bytes
        try:
            if self._maps is not None:
                data = self._maps.view(path, start, self.chunk_bytes)
            else:
                with open(path, "rb") as f:
                    data = os.pread(f.fileno(), self.chunk_bytes, start)
        except FileNotFoundError:
            self._error(ident, request.req, "gone", f"v{request.version} is no longer held")
            return
        self.served_bytes += len(data)
        self.out.send(ident, [MAGIC, CHUNK, P.pack({"req": request.req, "file": request.file, "index": request.index}),
                              data])

    def _send(self, ident: bytes, command: bytes, header: dict[str, Any]) -> None:
        public = dict(header)
        if "files" in public:
            public["files"] = [{k: v for k, v in f.items() if k != "source"} for f in public["files"]]
        self.out.send(ident, [MAGIC, command, P.pack(public)])

    def _error(self, ident: bytes, req: int | None, code: str, message: str) -> None:
        error = {"code": code, "message": message} if req is None else {"req": req, "code": code, "message": message}
        self.out.send(ident, [MAGIC, ERROR, P.pack(error)])


class FileMaps:
    """The files being served, mapped read-only, the last few used: a chunk goes to ZeroMQ as a view of the page
    cache, and the kernel copies it once, into the socket, where a read would first copy it into this process
    (half the serving CPU per byte on a two-core host: 0.20 s/GB against 0.31-0.47).

    A file replaced by rename, or deleted, keeps its old bytes mapped until its views are sent (the trainer's
    versions come and go so, and a client that asks for a replaced file's chunks gets the new file's). A file
    truncated in place would fault the process when ZeroMQ read past its new end: not for directories that others
    rewrite in place.
    """

    def __init__(self, keep: int = 16):
        self.keep = keep
        self._maps: OrderedDict[Path, tuple[int, mmap.mmap | None]] = OrderedDict()  # path -> (inode, map)

    def view(self, path: Path, start: int, length: int) -> memoryview:
        """Up to `length` bytes of `path` from `start`; FileNotFoundError when it is gone."""
        held = self._maps.get(path)
        if held is None or held[0] != os.stat(path).st_ino:
            with open(path, "rb") as f:
                stat = os.fstat(f.fileno())
                held = (stat.st_ino, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if stat.st_size else None)
            self._maps[path] = held  # a map dropped here is unmapped once ZeroMQ has sent its last view
        self._maps.move_to_end(path)
        while len(self._maps) > self.keep:
            self._maps.popitem(last=False)
        return memoryview(held[1] if held[1] is not None else b"")[start:start + length]


def main(argv: list[str] | None = None) -> None:
    """Serve a directory of published versions (v1/, v2/, ...) on its own, until SIGTERM, SIGINT or SIGHUP."""
    import argparse
    from rlbus.common.processes import on_stop_signals

    parser = argparse.ArgumentParser(prog="python -m rlbus.weights.server", description=main.__doc__)
    parser.add_argument("dir", help="the directory holding the published versions v1/, v2/, ...")
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to bind (0.0.0.0: every IPv4 one; ::, every one)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (0: a free one)")
    parser.add_argument("--chunk-mb", type=float, default=4.0, help="chunk size in MB")
    parser.add_argument("--delta-priority", choices=("idle", "normal"), default="idle",
                        help="idle: build deltas only on CPU nothing else wants (default); normal: compete for it")
    args = parser.parse_args(argv)
    from rlbus.common.logging import setup_logging

    setup_logging("weight-server")
    server = WeightServer(args.dir, args.host, args.port, chunk_bytes=int(args.chunk_mb * (1 << 20)),
                          delta_priority=args.delta_priority)
    stop = threading.Event()
    on_stop_signals(stop.set)
    server.start()
    print(server.address, flush=True)
    # Python runs a signal's handler in the main thread, and a signal the kernel hands to one of the server's
    # threads does not wake a main thread blocked without a timeout: it would never stop (seen 2 times in 30).
    while not stop.wait(0.5):
        pass
    server.close()


if __name__ == "__main__":
    main()

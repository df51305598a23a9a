"""Weights over the network: deltas, the weight server and fetch_version, on loopback with real sockets.

The server runs in a thread of the test (as it does in the trainer), or as its own process where a test kills
it; a corrupting link is a real ZeroMQ proxy between client and server.
"""

from __future__ import annotations

import faulthandler
import filecmp
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zmq

torch = pytest.importorskip("torch")
pytest.importorskip("zstandard")
from safetensors.torch import save_file  # noqa: E402

from rlbus.common import protocol as P  # noqa: E402
from rlbus.common.curve import make_keys  # noqa: E402
from rlbus.weights.delta import apply_delta, make_delta  # noqa: E402
from rlbus.weights.digest import weights_digest  # noqa: E402
from rlbus.weights.fetch import SPARE, Base, FetchFailed, SpareWarmer, fetch_version, retire  # noqa: E402
from rlbus.weights.server import CHUNK, MAGIC, MANIFEST, MAX_REQUEST_BYTES, WeightServer  # noqa: E402
from tests.conftest import REPO, free_port, ipv6_loopback  # noqa: E402
from tests.helpers.served import CHUNK_BYTES, publish_versions, state_of  # noqa: E402

def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(filecmp.cmp(a / n, b / n, shallow=False)
                                                                 for n in names)


def test_a_delta_chain_gives_the_bytes_of_the_full_version(tmp_path):
    digests = publish_versions(tmp_path / "w", 3)
    assert len(set(digests.values())) == 3
    held = tmp_path / "w" / "v1" / "model.safetensors"
    for v in (2, 3):
        target = tmp_path / "w" / f"v{v}" / "model.safetensors"
        size = make_delta(held, target, tmp_path / f"d{v}.zst")
        assert size is not None and size < 0.25 * target.stat().st_size
        rebuilt = tmp_path / f"rebuilt{v}"
        assert apply_delta(held, tmp_path / f"d{v}.zst", rebuilt) == target.stat().st_size
        assert rebuilt.read_bytes() == target.read_bytes()
        held = rebuilt
    # A file of another layout has no delta; a delta refuses a base of another length.
    other = tmp_path / "other.safetensors"
    save_file({"embed": torch.zeros(4, 4)}, str(other))
    assert make_delta(other, tmp_path / "w" / "v2" / "model.safetensors", tmp_path / "x.zst") is None
    with pytest.raises(ValueError, match="longer than its base|covers"):
        apply_delta(other, tmp_path / "d2.zst", tmp_path / "bad")


@pytest.mark.parametrize("served", [False, True], ids=["read", "mapped"], indirect=True)
def test_full_fetch_then_deltas_against_the_version_held(served, tmp_path):
    server, root, digests = served
    dest = tmp_path / "explorer"
    first = fetch_version(server.address, 1, digests[1], dest)
    assert first.base is None and same_files(first.path, root / "v1")
    assert first.received_bytes == first.version_bytes
    second = fetch_version(server.address, 2, digests[2], dest, Base(1, first.path, digests[1]))
    assert second.base == 1 and same_files(second.path, root / "v2")
    assert second.received_bytes < 0.25 * second.version_bytes  # the config file came from the base, not the wire
    third = fetch_version(server.address, 3, digests[3], dest, Base(1, first.path, digests[1]))
    assert third.base == 1 and same_files(third.path, root / "v3")
    # A base whose digest the server does not know gets the whole version.
    whole = fetch_version(server.address, 3, digests[3], tmp_path / "other", Base(2, second.path, "xxh3_128:0"))
    assert whole.base is None and same_files(whole.path, root / "v3")
    # Already there: nothing crosses the network.
    assert fetch_version(server.address, 3, digests[3], dest).received_bytes == 0


def test_a_fetch_writes_over_the_spare_version_whole_or_by_delta(served, tmp_path):
    server, root, digests = served
    weights = "model.safetensors"
    for by_delta in (False, True):
        dest = tmp_path / f"explorer-{by_delta}"
        fetch_version(server.address, 1, digests[1], dest)
        second = fetch_version(server.address, 2, digests[2], dest)
        retire(dest, keep=second.path)
        spare = (dest / SPARE / weights).stat().st_ino  # v1's file
        base = Base(2, second.path, digests[2]) if by_delta else None
        third = fetch_version(server.address, 3, digests[3], dest, base)
        assert third.base == (2 if by_delta else None)
        assert (third.path / weights).stat().st_ino == spare, "written over v1's file, not a new one"
        assert same_files(third.path, root / "v3") and same_files(second.path, root / "v2")
        retire(dest, keep=third.path)
        assert sorted(p.name for p in dest.iterdir()) == [SPARE, "v3"] and same_files(dest / SPARE, root / "v2")


def test_an_explorer_with_one_version_writes_a_spare_for_the_next_fetch(served, tmp_path):
    from rlbus.weights.sync import Receiver

    server, root, digests = served
    weights = "model.safetensors"
    engine, receiver = RecordingEngine(), Receiver("e", tmp_path / "fetched", mode="fetch")
    assert receiver.load(engine, state_of(server, root, digests, 1))
    assert receiver._warmer is not None and receiver._warmer.wait(30)
    spare = tmp_path / "fetched" / SPARE / weights
    assert spare.stat().st_size == (root / "v1" / weights).stat().st_size
    inode = spare.stat().st_ino
    assert receiver.load(engine, state_of(server, root, digests, 2))
    assert (tmp_path / "fetched" / "v2" / weights).stat().st_ino == inode, "written over the spare"
    assert same_files(tmp_path / "fetched" / "v2", root / "v2")
    assert receiver._warmer is None  # v1 is the spare now
    assert sorted(p.name for p in (tmp_path / "fetched").iterdir()) == [SPARE, "v2"]
    assert same_files(tmp_path / "fetched" / SPARE, root / "v1")
    receiver.close()
    # A spare cut short (a fetch began while it was written) still serves, as far as it goes.
    dest = tmp_path / "cut"
    first = fetch_version(server.address, 1, digests[1], dest)
    warmer = SpareWarmer(dest, first.path)
    warmer.stop()
    assert warmer.wait(0)
    second = fetch_version(server.address, 2, digests[2], dest)
    assert same_files(second.path, root / "v2")


def test_the_server_builds_ahead_the_delta_clients_will_ask_for(served, tmp_path):
    import time

    server, root, digests = served
    deltas = root / ".deltas"
    built = lambda: sorted(p.name.split(".")[0] for p in deltas.glob("v*-v*")) if deltas.is_dir() else []  # noqa: E731
    # v3 is written: `add` takes its digest and whole manifest in one read; nobody has taken a delta yet, so
    # none is built ahead.
    assert server.add(3, (2, digests[2])) == digests[3]
    fetch_version(server.address, 1, digests[1], tmp_path / "sync")  # queued behind anything `add` queued
    assert built() == []
    whole = server.manifests.get(3, None, "")
    assert whole.done(), "the whole manifest was made by add, not left to the builder"
    assert whole.result()["files"] == server.manifests._build_manifest(3, None, "")["files"]
    second = fetch_version(server.address, 2, digests[2], tmp_path / "e", Base(1, root / "v1", digests[1]))
    assert second.base == 1 and built() == ["v1-v2"]
    server.add(3, (2, digests[2]))  # v3 again: now its delta from v2 is built before anyone asks
    deadline = time.monotonic() + 30
    while built() != ["v1-v2", "v2-v3"]:
        assert time.monotonic() < deadline, built()
        time.sleep(0.01)
    third = fetch_version(server.address, 3, digests[3], tmp_path / "e", Base(2, second.path, digests[2]))
    assert third.base == 2 and same_files(third.path, root / "v3")


def test_the_digest_taken_as_chunks_arrive_in_any_order_is_the_digest_of_the_files(tmp_path):
    import random

    from rlbus.weights.fetch import _InOrderDigest
    from rlbus.weights.digest import chunk_hashes

    root = tmp_path / "v"
    root.mkdir()
    rng = random.Random(0)
    for name, size in (("a.safetensors", 5 * CHUNK_BYTES + 17), ("b.safetensors", 3 * CHUNK_BYTES), ("config.json", 40)):
        (root / name).write_bytes(rng.randbytes(size))
    files = [{"name": p.name, "chunks": chunk_hashes(p, CHUNK_BYTES)[0]} for p in sorted(root.iterdir())]
    chunks = [(fi, ci) for fi, e in enumerate(files) for ci in range(len(e["chunks"]))]
    want = weights_digest(root, "xxh3_128")

    def data(fi, ci):
        with open(root / files[fi]["name"], "rb") as f:
            return memoryview(os.pread(f.fileno(), CHUNK_BYTES, ci * CHUNK_BYTES))

    for kept in (set(), {(0, 0), (0, 5), (1, 2)}):  # chunks a resumed fetch found on disk already
        todo = [c for c in chunks if c not in kept]
        arrival = todo[:]
        rng.shuffle(arrival)
        running = _InOrderDigest(files, root, "xxh3_128", todo, CHUNK_BYTES, limit=len(chunks))
        for fi, ci in arrival:
            running.add(fi, ci, data(fi, ci))
        assert running.result() == want
    # More chunks early than it may hold: no digest, and the caller reads the files instead.
    running = _InOrderDigest(files, root, "xxh3_128", chunks, CHUNK_BYTES, limit=2)
    for fi, ci in reversed(chunks):
        running.add(fi, ci, data(fi, ci))
    assert running.result() is None


def test_a_whole_version_is_checked_without_reading_it_again(served, tmp_path, monkeypatch):
    from rlbus.weights import fetch

    server, root, digests = served

    def read_again(*args):
        raise AssertionError("the fetched files were read again for their digest")

    monkeypatch.setattr(fetch, "matches", read_again)
    got = fetch_version(server.address, 2, digests[2], tmp_path / "e")
    assert got.base is None and same_files(got.path, root / "v2")


def test_the_announced_digest_is_checked(served, tmp_path):
    server, _, digests = served
    with pytest.raises(FetchFailed, match="digest"):
        fetch_version(server.address, 2, digests[1], tmp_path / "e")
    assert not (tmp_path / "e" / "v2").exists()


class CorruptingLink:
    """A ROUTER-DEALER relay that flips one byte of the n-th CHUNK it carries back, once."""

    def __init__(self, upstream: str, corrupt_at: int):
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.back = self.ctx.socket(zmq.DEALER)
        self.back.connect(upstream)
        self.corrupt_at, self.seen, self.corrupted = corrupt_at, 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        client = None
        while not self.stop.is_set():
            for sock, _ in poller.poll(50):
                frames = sock.recv_multipart()
                if sock is self.front:
                    client = frames[0]
                    self.back.send_multipart(frames[1:])
                    continue
                if frames[1] == CHUNK:
                    self.seen += 1
                    if self.seen == self.corrupt_at:
                        data = bytearray(frames[3])
                        data[len(data) // 2] ^= 0xFF
                        frames[3] = bytes(data)
                        self.corrupted += 1
                self.front.send_multipart([client, *frames])

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.ctx.destroy(0)


def test_a_corrupted_chunk_is_refused_and_fetched_again(served, tmp_path):
    server, root, digests = served
    link = CorruptingLink(server.address, corrupt_at=3)
    try:
        got = fetch_version(f"tcp://127.0.0.1:{link.port}", 1, digests[1], tmp_path / "e")
    finally:
        link.close()
    assert link.corrupted == 1 and got.bad_chunks == 1
    assert same_files(got.path, root / "v1")


def test_mapped_files_give_the_bytes_of_the_file_under_the_path_now(tmp_path):
    """FileMaps: a chunk of a mapped file is the file's bytes; a file replaced by rename gives the new file's bytes
    (a view taken before keeps the old); a deleted file is FileNotFoundError; an empty file gives no bytes."""
    from rlbus.weights.server import FileMaps

    maps, path = FileMaps(keep=2), tmp_path / "w.bin"
    old = os.urandom(10_000)
    path.write_bytes(old)
    before = maps.view(path, 4096, 4096)
    assert bytes(before) == old[4096:8192] and bytes(maps.view(path, 8192, 4096)) == old[8192:]
    new = os.urandom(5_000)
    (tmp_path / "w.tmp").write_bytes(new)
    os.replace(tmp_path / "w.tmp", path)
    assert bytes(maps.view(path, 4096, 4096)) == new[4096:] and bytes(before) == old[4096:8192]
    (tmp_path / "empty").write_bytes(b"")
    assert bytes(maps.view(tmp_path / "empty", 0, 4096)) == b""
    for i in range(3):  # more files than it keeps: the oldest maps are dropped, what is asked is still right
        (tmp_path / f"f{i}").write_bytes(bytes([i]) * 100)
        assert bytes(maps.view(tmp_path / f"f{i}", 10, 5)) == bytes([i]) * 5
    assert len(maps._maps) == 2
    path.unlink()
    with pytest.raises(FileNotFoundError):
        maps.view(path, 0, 10)


def start_server(root: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "rlbus.weights.server", str(root), "--port", str(port),
                             "--chunk-mb", str(CHUNK_BYTES / (1 << 20))], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout.readline().strip() == f"tcp://127.0.0.1:{port}"
    return proc


def stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:  # fails the test, but leaves no server behind
        proc.kill()
        proc.wait()
        raise


def test_a_fetch_resumes_when_the_server_is_killed_and_restarted_midway(tmp_path):
    root = tmp_path / "served"
    digests = publish_versions(root, 1)
    port = free_port()
    procs = [start_server(root, port)]
    restarted = threading.Event()

    def on_chunk(done: int, total: int) -> None:
        if done >= total // 2 and not restarted.is_set():
            restarted.set()
            stop(procs[-1], signal.SIGKILL)
            procs.append(start_server(root, port))

    try:
        got = fetch_version(f"tcp://127.0.0.1:{port}", 1, digests[1], tmp_path / "e", retry_s=0.5, timeout_s=30,
                            on_chunk=on_chunk)
    finally:
        for p in procs:
            stop(p)
    assert restarted.is_set()  # (the old server may have answered what was outstanding before it died)
    assert same_files(got.path, root / "v1")
    assert got.received_bytes <= got.version_bytes + 4 * CHUNK_BYTES  # what came before the kill was kept


def test_a_fetch_given_up_resumes_from_the_chunks_already_on_disk(tmp_path):
    root = tmp_path / "served"
    digests = publish_versions(root, 1)
    port = free_port()
    procs = [start_server(root, port)]
    total_bytes = (root / "v1" / "model.safetensors").stat().st_size

    def on_chunk(done: int, total: int) -> None:
        if done >= total // 2:
            stop(procs[0], signal.SIGKILL)

    dest = tmp_path / "e"
    with pytest.raises(FetchFailed, match="no reply"):
        fetch_version(f"tcp://127.0.0.1:{port}", 1, digests[1], dest, retry_s=0.2, timeout_s=1.0, on_chunk=on_chunk)
    assert (dest / ".v1.partial").is_dir() and not (dest / "v1").exists()
    procs.append(start_server(root, port))
    try:
        got = fetch_version(f"tcp://127.0.0.1:{port}", 1, digests[1], dest)
    finally:
        stop(procs[-1])
    assert same_files(got.path, root / "v1")
    assert got.received_bytes < 0.75 * total_bytes


def ask(sock: zmq.Socket, frames: list[bytes], server: WeightServer) -> tuple[bytes, dict]:
    """The server's answer. What is asserted is the answer, not how soon it comes: on a loaded two-core host a
    test process has gone unscheduled for 3.4 s (all its threads, faulthandler's watchdog too), so the
    wait is long, and a failure says where every thread was."""
    sock.send_multipart(frames)
    if not sock.poll(30_000):
        faulthandler.dump_traceback(all_threads=True)  # to the captured stderr
        pytest.fail(f"the weight server did not answer {frames[:2]} in 30 s (serving thread alive: "
                    f"{server._thread.is_alive()})")
    reply = sock.recv_multipart()
    return reply[1], P.unpack(reply[2])


def test_requests_name_versions_and_files_never_paths_and_bad_input_gets_an_error(served, dealer):
    server, sock = served[0], dealer
    cases = [
        ([MAGIC, CHUNK, P.pack({"req": 1, "version": 1, "file": "../../../etc/passwd"})], "bad_request", 1),
        ([MAGIC, CHUNK, P.pack({"req": 2, "version": 1, "file": "config.json", "index": 7})], "bad_request", 2),
        ([MAGIC, MANIFEST, P.pack({"req": 3, "version": 99})], "gone", 3),
        ([MAGIC, MANIFEST, P.pack({"req": 4, "version": "v1/../.."})], "bad_request", 4),
        ([MAGIC, MANIFEST, P.pack({"req": 5, "version": -1})], "bad_request", 5),
        ([MAGIC, MANIFEST, P.pack({"req": 10, "version": 2, "base": 1, "base_digest": "x", "delta_wait_ms": -5})],
         "bad_request", 10),
        ([MAGIC, MANIFEST, P.pack({"req": 11, "version": 2, "base": 1, "delta_wait_ms": "soon"})], "bad_request", 11),
        ([MAGIC, b"DELETE", P.pack({"req": 6, "version": 1})], "bad_request", 6),
        ([MAGIC, MANIFEST, b"\xc1not msgpack"], "bad_request", None),
        # A field the request does not name, nested past what the decoder follows: `req`, before it, is read.
        ([MAGIC, MANIFEST, b"\x83\xa3req\x0c\xa7version\x01\xa1x" + b"\x91" * 30_000 + b"\x01"], "bad_request", 12),
        ([b"http/1.1", b"GET /"], "bad_request", None),
        ([b"rlbus-weights/2", MANIFEST, P.pack({"req": 19, "version": 1})], "bad_request", 19),
        ([MAGIC, MANIFEST, P.pack({"req": 12, "version": 1, "pad": "x" * MAX_REQUEST_BYTES})], "bad_request", 12),
        ([MAGIC, MANIFEST, P.pack({"pad": "x" * MAX_REQUEST_BYTES, "req": 20, "version": 1})], "bad_request", 20),
        ([MAGIC, MANIFEST, P.pack({"req": 13, "version": True})], "bad_request", 13),
        ([MAGIC, MANIFEST, P.pack({"req": 14, "version": 1 << 53})], "bad_request", 14),
        ([MAGIC, CHUNK, P.pack({"req": 15, "version": 1, "file": "config.json", "index": -1})], "bad_request", 15),
        ([MAGIC, MANIFEST, P.pack({"req": -16, "version": 1})], "bad_request", None),
        ([MAGIC, CHUNK, P.pack({"req": 17, "version": 1, "file": "config.json"})], "bad_request", 17),
        ([MAGIC, CHUNK, P.pack({"req": 18, "version": 1, "index": 0})], "bad_request", 18),
    ]
    # Each is answered with its `req` wherever that can be read (an unsigned integer), and without one otherwise.
    for frames, code, req in cases:
        command, header = ask(sock, frames, server)
        assert (command, header["code"], header.get("req")) == (b"ERROR", code, req), (frames, header)
        assert ("req" in header) == (req is not None), header  # never nil
    # Still serving.
    command, header = ask(sock, [MAGIC, MANIFEST, P.pack({"req": 9, "version": 2})], server)
    assert command == MANIFEST and header["req"] == 9
    assert {f["name"] for f in header["files"]} == {"config.json", "model.safetensors"}
    assert all("source" not in f for f in header["files"])


def test_with_curve_only_admitted_clients_are_served(tmp_path):
    root = tmp_path / "served"
    digests = publish_versions(root, 1)
    keys, admitted = tmp_path / "keys", tmp_path / "admitted"
    _, trainer_secret = make_keys(keys, "trainer")
    explorer_public, explorer_secret = make_keys(keys, "explorer")
    _, stranger_secret = make_keys(tmp_path / "strangers", "stranger")
    admitted.mkdir()
    (admitted / explorer_public.name).write_bytes(explorer_public.read_bytes())
    server = WeightServer(root, chunk_bytes=CHUNK_BYTES, curve=(str(trainer_secret), str(admitted))).start()
    try:
        assert server.public_key
        got = fetch_version(server.address, 1, digests[1], tmp_path / "e", server_key=server.public_key,
                            client_secret_file=str(explorer_secret))
        assert same_files(got.path, root / "v1")
        with pytest.raises(FetchFailed, match="no reply"):
            fetch_version(server.address, 1, digests[1], tmp_path / "s", server_key=server.public_key,
                          client_secret_file=str(stranger_secret), retry_s=0.2, timeout_s=1.0)
        with pytest.raises(FetchFailed, match="no reply"):  # in the clear: no handshake, no reply
            fetch_version(server.address, 1, digests[1], tmp_path / "c", retry_s=0.2, timeout_s=1.0)
    finally:
        server.close()


class RecordingEngine:
    """A stand-in for the vLLM engine (its real counterpart is exercised by tests/test_hosts.py)."""

    def __init__(self):
        self.version = 0
        self.sources: list[dict] = []

    def reload(self, source: dict, version: int) -> dict:
        self.sources.append(source)
        self.version = version
        return {}


def test_the_receiver_reads_the_path_when_it_can_and_fetches_deltas_when_it_cannot(served, tmp_path):
    from rlbus.weights.sync import Receiver

    server, root, digests = served
    engine, receiver = RecordingEngine(), Receiver("e1", tmp_path / "fetched")
    assert receiver.load(engine, state_of(server, root, digests, 1))
    assert engine.sources[-1] == {"method": "checkpoint", "path": str(root / "v1")}
    # The announced directory is not there on this host: v2 comes by fetch, as a delta against v1.
    gone = tmp_path / "elsewhere" / "v2"
    assert receiver.load(engine, state_of(server, root, digests, 2, location=gone))
    assert engine.sources[-1] == {"method": "checkpoint", "path": str(tmp_path / "fetched" / "v2")}
    assert receiver.held.version == 2 and engine.version == 2
    assert server.served_bytes < 0.25 * (root / "v2" / "model.safetensors").stat().st_size  # a delta against v1
    assert receiver.load(engine, state_of(server, root, digests, 3, location=tmp_path / "elsewhere" / "v3"))
    # v2 is kept as the spare the next fetch writes over; v1 is gone.
    assert sorted(p.name for p in (tmp_path / "fetched").iterdir()) == [SPARE, "v3"]
    assert same_files(tmp_path / "fetched" / SPARE, root / "v2")
    assert same_files(tmp_path / "fetched" / "v3", root / "v3")
    # receive: fetch never reads the path, even where it could.
    engine2, fetching = RecordingEngine(), Receiver("e2", tmp_path / "f2", mode="fetch")
    assert fetching.load(engine2, state_of(server, root, digests, 3))
    assert engine2.sources[-1]["path"] == str(tmp_path / "f2" / "v3")
    # Nowhere to get it from: not loaded, and said so.
    engine3 = RecordingEngine()
    state = state_of(server, root, digests, 2, location=gone)
    del state["fetch_from"]
    assert not Receiver("e3", tmp_path / "f3").load(engine3, state) and engine3.version == 0


def test_a_port_in_use_is_a_clear_error(served, tmp_path):
    server, _, _ = served
    port = int(server.address.rsplit(":", 1)[1])
    with pytest.raises(OSError, match="sync.serve_port"):
        WeightServer(tmp_path / "other", port=port)


@ipv6_loopback
@pytest.mark.parametrize("host", ["::1", "::"])
def test_a_weight_server_on_an_ipv6_address_is_fetched_from_the_address_it_announces(tmp_path, host):
    """The address is one the broker takes as `fetch_from` (an IPv6 address in brackets; `::`, every interface,
    announces this machine's name), and a fetch from it, whole then by delta, gives the files."""
    digests = publish_versions(tmp_path / "w", 2)
    server = WeightServer(tmp_path / "w", host=host, chunk_bytes=CHUNK_BYTES).start()
    try:
        assert P.ENDPOINT.fullmatch(server.address)
        port = server.address.rpartition(":")[2]
        assert server.address == (f"tcp://[::1]:{port}" if host == "::1" else f"tcp://{socket.gethostname()}:{port}")
        for at in ("[::1]", "127.0.0.1") if host == "::" else ("[::1]",):
            dest = tmp_path / f"fetched-{at}"
            first = fetch_version(f"tcp://{at}:{port}", 1, digests[1], dest, timeout_s=20)
            second = fetch_version(f"tcp://{at}:{port}", 2, digests[2], dest, Base(1, first.path, digests[1]),
                                   timeout_s=20)
            assert second.base == 1 and same_files(second.path, tmp_path / "w" / "v2")
    finally:
        server.close()


def test_the_trainer_announces_its_weight_server_and_what_it_publishes_can_be_fetched(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlbus.common.config import load_config
    from rlbus.weights.sync import make_sender

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    sender = make_sender(load_config(None, ["rollout.dtype=bfloat16"], environ={}), tmp_path / "weights", tiny_model)
    try:
        state = sender.publish(sender.snapshot(model), 1, 0)
        assert state["fetch_from"] == sender.server.address and state["fetch_from"].startswith("tcp://127.0.0.1:")
        got = fetch_version(state["fetch_from"], 1, state["digest"], tmp_path / "explorer")
        assert same_files(got.path, Path(state["location"]))
    finally:
        sender.close()
    off = make_sender(load_config(None, ["sync.serve=false"], environ={}), tmp_path / "w2", tiny_model)
    assert off.server is None and "fetch_from" not in off.publish(off.snapshot(model), 1, 0)


def test_a_trainer_that_publishes_every_third_step_keeps_the_bases_explorers_hold(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlbus.common.config import load_config
    from rlbus.weights.checkpoint import version_dirs
    from rlbus.weights.sync import make_sender

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    (tmp_path / "weights" / "v20").mkdir(parents=True)  # a version of the run before a restart
    sender = make_sender(load_config(None, ["rollout.dtype=float32"], environ={}), tmp_path / "weights", tiny_model)
    try:
        held = None
        for version in (3, 6, 9, 12):  # sync_interval 3: versions are step numbers
            with torch.no_grad():
                next(model.parameters()).add_(0.01)
            state = sender.publish(sender.snapshot(model), version, version - 1)
            got = fetch_version(state["fetch_from"], version, state["digest"], tmp_path / "explorer", held,
                                delta_wait_s=30)
            assert got.base == (held.version if held else None), (version, got)  # never the whole again
            held = Base(version, got.path, state["digest"])
        assert [v for v, _ in version_dirs(tmp_path / "weights")] == [6, 9, 12, 20]
    finally:
        sender.close()


def test_a_restarted_explorer_takes_deltas_against_the_version_it_fetched_before(served, tmp_path):
    from rlbus.weights.sync import Receiver

    server, root, digests = served
    elsewhere = tmp_path / "not-here"
    first = Receiver("e", tmp_path / "fetched")
    assert first.load(RecordingEngine(), state_of(server, root, digests, 2, location=elsewhere / "v2"))
    before = server.served_bytes
    restarted, engine = Receiver("e", tmp_path / "fetched"), RecordingEngine()
    engine.version = 2
    assert restarted.load(engine, state_of(server, root, digests, 3, location=elsewhere / "v3"))
    assert server.served_bytes - before < 0.25 * (root / "v3" / "model.safetensors").stat().st_size
    assert same_files(tmp_path / "fetched" / "v3", root / "v3")


class BroadcastFailsEngine(RecordingEngine):
    def reload(self, source: dict, version: int) -> dict:
        if source["method"] == "nccl":
            raise TimeoutError("the epoch was aborted")
        return super().reload(source, version)


def test_a_broadcast_member_that_misses_a_version_fetches_it(served, tmp_path):
    from rlbus.weights.sync import Receiver

    server, root, digests = served
    engine, receiver = BroadcastFailsEngine(), Receiver("member", tmp_path / "fetched")
    state = state_of(server, root, digests, 2, location=tmp_path / "not-here" / "v2")
    announcement = {"epoch": 1, "backend": "gloo", "address": "127.0.0.1:1", "world": 2, "ranks": {"member": 1},
                    "version": 2, "digest": digests[2], "timeout_s": 1.0}
    assert not receiver.load(engine, {**state, "location": "", "broadcast": announcement})  # checkpoint follows
    assert receiver.failed == {2} and engine.version == 0
    assert receiver.load(engine, state)
    assert engine.sources[-1] == {"method": "checkpoint", "path": str(tmp_path / "fetched" / "v2")}


def test_a_base_that_is_not_what_it_claims_gets_the_whole_version(served, tmp_path):
    from rlbus.weights.sync import Receiver

    server, root, digests = served
    elsewhere = tmp_path / "not-here"
    receiver, engine = Receiver("e", tmp_path / "fetched"), RecordingEngine()
    assert receiver.load(engine, state_of(server, root, digests, 2, location=elsewhere / "v2"))
    held = tmp_path / "fetched" / "v2" / "model.safetensors"
    data = bytearray(held.read_bytes())
    data[-100] ^= 0xFF  # the local copy rots after it was checked
    held.write_bytes(bytes(data))
    before = server.served_bytes
    assert receiver.load(engine, state_of(server, root, digests, 3, location=elsewhere / "v3"))
    assert server.served_bytes - before >= (root / "v3" / "model.safetensors").stat().st_size  # whole, after the delta
    assert same_files(tmp_path / "fetched" / "v3", root / "v3")

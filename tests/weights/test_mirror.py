"""A weight mirror (`rlbus mirror`): a real process that follows a real broker's bus, fetches each version from
the trainer's weight server once and serves it to explorers whose `explorer.fetch_from` names it."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

pytest.importorskip("torch")
pytest.importorskip("zstandard")

from rlbus.common import protocol as P  # noqa: E402
from rlbus.common.config import ConfigError, load_config  # noqa: E402
from rlbus.logview import events  # noqa: E402
from rlbus.weights.server import MAGIC, MANIFEST, WeightServer  # noqa: E402
from rlbus.weights.sync import Receiver  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.helpers.served import CHUNK_BYTES, publish_versions, state_of  # noqa: E402
from tests.weights.test_network import RecordingEngine, same_files, stop  # noqa: E402


def start_mirror(broker, directory, log):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "rlbus.cli", "mirror", "--broker", broker.address,
                             "--dir", str(directory), "--set", f"broker.pub_port={broker.pub_port}",
                             "--set", f"sync.serve_chunk_mb={CHUNK_BYTES / (1 << 20)}",
                             "--set", "logging.format=json", "--set", f"logging.file={log}"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    address = proc.stdout.readline().strip()
    assert address.startswith("tcp://127.0.0.1:"), f"the mirror printed {address!r} (exit {proc.poll()})"
    return proc, address


def test_a_mirror_fetches_each_version_once_and_serves_it_to_every_explorer(broker_factory, clients, tmp_path):
    b = broker_factory()
    root = tmp_path / "trainer"
    digests = publish_versions(root, 3)
    origin = WeightServer(root, chunk_bytes=CHUNK_BYTES)
    asked: dict[int, set[bytes]] = {}  # version -> the sockets that asked the trainer's server for its manifest
    on_request = origin._on_request

    def spy(frames, **kw):
        if frames[2:3] == [MANIFEST]:
            asked.setdefault(P.unpack(frames[3])["version"], set()).add(frames[0])
        on_request(frames, **kw)

    origin._on_request = spy
    origin.start()
    mirror, address = start_mirror(b, tmp_path / "mirror", tmp_path / "mirror.jsonl")
    try:
        trainer = clients(b, "trainer", "tr")
        elsewhere = tmp_path / "not-on-this-host"  # explorers cannot read the trainer's directory
        states = {v: state_of(origin, root, digests, v, location=elsewhere / f"v{v}") for v in (1, 2, 3)}
        engines = [RecordingEngine(), RecordingEngine()]
        receivers = [Receiver(f"e{i}", tmp_path / f"e{i}", mode="fetch", fetch_timeout_s=30, fetch_from=address)
                     for i in range(2)]
        # An explorer that asks before the mirror has heard of the version: its request waits for it.
        early = threading.Thread(target=lambda: receivers[0].load(engines[0], states[1]))
        early.start()
        time.sleep(0.5)
        trainer.request(P.PUBLISH, states[1])
        early.join(60)
        assert engines[0].version == 1
        for v in (2, 3):
            trainer.request(P.PUBLISH, states[v])
            for receiver, engine in zip(receivers, engines):
                if engine.version < v:
                    assert receiver.load(engine, states[v])
        for i, engine in enumerate(engines):
            assert engine.version == 3 and engine.sources[-1]["path"] == str(tmp_path / f"e{i}" / "v3")
            assert same_files(tmp_path / f"e{i}" / "v3", root / "v3")
        # The trainer's server was asked for each version once (each fetch is a socket of its own), and sent
        # each at most once.
        assert {v: len(peers) for v, peers in asked.items()} == {1: 1, 2: 1, 3: 1}
        sizes = sum(f.stat().st_size for v in (1, 2, 3) for f in (root / f"v{v}").iterdir())
        assert origin.served_bytes <= sizes
        stop(mirror)
        assert mirror.returncode == 0
        fetched = [e for e in events(tmp_path / "mirror.jsonl") if e["event"] == "weights_fetched"]
        assert [e["policy_version"] for e in fetched] == [1, 2, 3]
        # Restarted on its directory, it serves what it holds at once.
        mirror, address = start_mirror(b, tmp_path / "mirror", tmp_path / "mirror2.jsonl")
        late, engine = Receiver("late", tmp_path / "late", mode="fetch", fetch_from=address), RecordingEngine()
        assert late.load(engine, states[3]) and same_files(tmp_path / "late" / "v3", root / "v3")
        assert {v: len(peers) for v, peers in asked.items()} == {1: 1, 2: 1, 3: 1}
    finally:
        stop(mirror)
        origin.close()


def test_a_request_for_a_version_not_held_yet_waits_for_it_then_is_gone(tmp_path):
    root = tmp_path / "served"
    publish_versions(root, 2)
    (root / "v2").rename(tmp_path / "v2")
    server = WeightServer(root, chunk_bytes=CHUNK_BYTES, await_s=1.0).start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(server.address)
    try:
        def ask(req, version):
            sock.send_multipart([MAGIC, MANIFEST, P.pack({"req": req, "version": version})])

        ask(1, 2)
        ask(2, 5)
        assert not sock.poll(300)  # neither is here: both wait
        (tmp_path / "v2").rename(root / "v2")
        assert sock.poll(2000)
        _, command, header = sock.recv_multipart()
        assert command == MANIFEST and P.unpack(header)["req"] == 1
        assert sock.poll(3000)  # v5 never comes: gone once its wait is over
        _, command, header = sock.recv_multipart()
        assert P.unpack(header)["req"] == 2 and P.unpack(header)["code"] == "gone"
        ask(3, 1)  # a version held is answered at once, as by any server
        assert sock.poll(2000) and P.unpack(sock.recv_multipart()[2])["req"] == 3
    finally:
        sock.close(0)
        server.close()


def test_fetch_from_must_be_a_tcp_endpoint():
    assert load_config(None, ["explorer.fetch_from=tcp://mirror.local:7000"], environ={}).explorer.fetch_from
    with pytest.raises(ConfigError, match="fetch_from"):
        load_config(None, ["explorer.fetch_from=mirror.local:7000"], environ={})


def test_a_mirror_takes_a_new_runs_versions_under_numbers_it_holds_and_drops_the_old_runs_newer_ones(tmp_path):
    import shutil

    from rlbus.weights.mirror import Mirror

    old_run, new_run = publish_versions(tmp_path / "old", 3, seed=0), publish_versions(tmp_path / "new", 2, seed=1)
    for v in (1, 2, 3):
        shutil.copytree(tmp_path / "old" / f"v{v}", tmp_path / "mirror" / f"v{v}")
    origin = WeightServer(tmp_path / "new", chunk_bytes=CHUNK_BYTES).start()
    cfg = load_config(None, ["broker.address=tcp://127.0.0.1:9", f"sync.serve_chunk_mb={CHUNK_BYTES / (1 << 20)}"],
                      environ={})
    mirror = Mirror(cfg, tmp_path / "mirror")  # not run: it follows no bus, its fetches are called here
    try:
        assert mirror.held == (3, old_run[3])  # what it held before a restart
        state = state_of(origin, tmp_path / "new", new_run, 2)
        assert not mirror._wanted({**state, "digest": old_run[2]})  # the same bytes under that number
        assert not mirror._wanted({**state, "fetch_from": mirror.address})  # never from itself
        assert mirror._wanted({**state, "version": 4}) and mirror._wanted(state)
        assert mirror._fetch(state) and mirror.held == (2, new_run[2])
        # v3 was the old run's: gone; v2 is the new run's; v1 the old run's, kept as a base (its digest says so).
        assert sorted(p.name for p in (tmp_path / "mirror").glob("v*")) == ["v1", "v2"]
        assert same_files(tmp_path / "mirror" / "v2", tmp_path / "new" / "v2")
    finally:
        mirror.server.close()
        origin.close()


def test_with_curve_a_mirror_fetches_with_its_own_key_and_serves_only_admitted_explorers(broker_factory, clients,
                                                                                       tmp_path):
    import subprocess
    import sys

    from rlbus.common.curve import make_keys

    keys = tmp_path / "keys"
    make_keys(keys / "broker", "broker")
    for name in ("trainer", "mirror", "explorer"):
        make_keys(keys / "admitted", name)
    _, stranger = make_keys(keys / "strangers", "stranger")
    curve = [f"broker.curve_server_key={keys}/broker/broker.key", f"broker.curve_authorized_dir={keys}/admitted"]
    b = broker_factory(f"broker.curve_secret_key={keys}/broker/broker.key_secret", curve[1])
    root = tmp_path / "trainer"
    digests = publish_versions(root, 1)
    origin = WeightServer(root, chunk_bytes=CHUNK_BYTES,
                          curve=(f"{keys}/admitted/trainer.key_secret", f"{keys}/admitted")).start()
    log = tmp_path / "mirror.jsonl"
    argv = [sys.executable, "-m", "rlbus.cli", "mirror", "--broker", b.address, "--dir", str(tmp_path / "mirror")]
    for item in [f"broker.pub_port={b.pub_port}", f"sync.serve_chunk_mb={CHUNK_BYTES / (1 << 20)}", *curve,
                 f"broker.curve_client_key={keys}/admitted/mirror.key_secret", "logging.format=json",
                 f"logging.file={log}"]:
        argv += ["--set", item]
    mirror = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        address = mirror.stdout.readline().strip()
        assert address.startswith("tcp://"), f"the mirror printed {address!r} (exit {mirror.poll()})"
        deadline = time.monotonic() + 30
        while not (started := [e for e in events(log) if e["event"] == "mirror_started"]):
            assert time.monotonic() < deadline and mirror.poll() is None, "the mirror never joined the broker"
            time.sleep(0.1)
        mirror_key = started[0]["public_key"]
        trainer = clients(b, "trainer", "tr", curve_server_key=f"{keys}/broker/broker.key",
                          curve_client_key=f"{keys}/admitted/trainer.key_secret")
        state = {**state_of(origin, root, digests, 1, location=tmp_path / "elsewhere" / "v1"),
                 "fetch_key": origin.public_key}
        trainer.request(P.PUBLISH, state)
        admitted = Receiver("e", tmp_path / "e", mode="fetch", fetch_timeout_s=30, fetch_from=address,
                            fetch_key=mirror_key, client_secret_file=f"{keys}/admitted/explorer.key_secret")
        engine = RecordingEngine()
        assert admitted.load(engine, state) and same_files(tmp_path / "e" / "v1", root / "v1")
        outsider = Receiver("s", tmp_path / "s", mode="fetch", fetch_timeout_s=1, fetch_from=address,
                            fetch_key=mirror_key, client_secret_file=str(stranger))
        assert not outsider.load(RecordingEngine(), state)  # no handshake, no reply: the fetch gives up
    finally:
        stop(mirror)
        origin.close()

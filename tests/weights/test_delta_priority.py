"""Deltas from CPU that training leaves: the weight server builds them in a child process at idle priority, and
a client whose delta is not built within the time it says gets the whole version. Real server, sockets and
child processes on loopback; a delta build is held back by wrapping the real one."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

pytest.importorskip("zstandard")
from structlog.testing import capture_logs  # noqa: E402

from rlbus.weights import manifests as manifests_module  # noqa: E402
from rlbus.weights import server as server_module  # noqa: E402
from rlbus.weights.fetch import Base, fetch_version  # noqa: E402
from rlbus.weights.manifests import Manifests  # noqa: E402
from rlbus.weights.server import WeightServer  # noqa: E402
from tests.helpers.served import CHUNK_BYTES, state_of  # noqa: E402

linux_only = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")


def same_files(a, b) -> bool:
    names = sorted(p.name for p in b.iterdir() if p.is_file())
    return names == sorted(p.name for p in a.iterdir() if p.is_file()) and \
        all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


@pytest.fixture
def held_builds(monkeypatch):
    """Delta builds wait until the returned event is set; then they are the real ones."""
    release, real = threading.Event(), Manifests._make_delta

    def slow_make_delta(self, *args):
        assert release.wait(60), "the test never let the build go"
        return real(self, *args)

    monkeypatch.setattr(Manifests, "_make_delta", slow_make_delta)
    yield release
    release.set()


def built_all(server) -> None:
    """Wait until the server has no delta build left to finish."""
    deadline = time.monotonic() + 30
    while server.manifests.backlog:
        assert time.monotonic() < deadline, "a delta build never finished"
        time.sleep(0.01)


def test_the_delta_child_process_runs_at_idle_priority_when_asked(tmp_path):
    import json
    import subprocess
    import sys

    from tests.helpers.served import publish_versions

    publish_versions(tmp_path, 2)
    for flag, idle in (["--idle"], hasattr(os, "SCHED_IDLE")), ([], False):
        out = tmp_path / f"delta{len(flag)}.zst"
        files = [str(tmp_path / v / "model.safetensors") for v in ("v1", "v2")]
        reply = subprocess.run([sys.executable, "-m", "rlbus.weights.delta", *flag, *files, str(out)],
                               capture_output=True, text=True, check=True, timeout=60).stdout
        figures = json.loads(reply)
        assert (figures["size"], figures["idle"]) == (out.stat().st_size, idle) and figures["cpu_s"] > 0


@linux_only
def test_the_server_builds_deltas_at_idle_priority_unless_told_otherwise(served):
    server, root, digests = served
    for priority, idle in (("idle", True), ("normal", False)):
        if priority == "normal":
            shutil.rmtree(root / ".deltas")  # built by the first server: built again by the second
        other = server if priority == "idle" else WeightServer(root, chunk_bytes=CHUNK_BYTES, delta_priority=priority)
        try:
            with capture_logs() as logs:
                got = other.manifests.get(2, 1, digests[1]).result(60)
            assert got["base"] == 1
            built = [e for e in logs if e["event"] == "weights_manifest_built"]
            assert [(e["built"], e["idle"]) for e in built] == [(1, idle)], priority
        finally:
            if other is not server:
                other.close()
    with pytest.raises(ValueError, match="delta_priority"):
        WeightServer(root, delta_priority="low")


def test_closing_the_server_stops_a_build_at_once(served, monkeypatch):
    """A build starved at idle priority must not hold up the trainer's exit: closing kills the child."""
    server, _, digests = served
    monkeypatch.setattr(manifests_module, "delta_command", lambda *_: ["sleep", "600"])  # a build that never ends
    future = server.manifests.get(2, 1, digests[1])
    deadline = time.monotonic() + 30
    while server.manifests._child is None:
        assert time.monotonic() < deadline, "the build never started"
        time.sleep(0.01)
    child = server.manifests._child
    server.close()
    assert child.wait(30) != 0
    with pytest.raises(RuntimeError, match="failed"):
        future.result(30)


def test_a_delta_not_built_within_the_wait_comes_whole_and_later_as_a_delta(served, held_builds, tmp_path):
    server, root, digests = served
    base = Base(1, root / "v1", digests[1])
    started = time.monotonic()
    with capture_logs() as logs:
        whole = fetch_version(server.address, 2, digests[2], tmp_path / "a", base, delta_wait_s=0.3)
    assert time.monotonic() - started >= 0.3
    assert whole.base is None and same_files(whole.path, root / "v2")
    assert whole.received_bytes >= (root / "v2" / "model.safetensors").stat().st_size
    assert any(e["event"] == "weights_delta_not_ready" and e["waited_s"] == 0.3 for e in logs)
    held_builds.set()  # the build goes on after the client stopped waiting, for the next one that asks
    delta = fetch_version(server.address, 2, digests[2], tmp_path / "b", base, delta_wait_s=30)
    assert delta.base == 1 and same_files(delta.path, root / "v2")
    assert delta.received_bytes < 0.25 * delta.version_bytes


def test_a_builder_that_is_behind_sends_the_whole_version_at_once_and_takes_no_more_ahead(served, held_builds,
                                                                                          tmp_path):
    server, root, digests = served
    server.manifests.delta_asked = True
    server.add(2, (1, digests[1]))  # published, its delta started ahead (and held)
    assert server.manifests.backlog == 1
    with capture_logs() as logs:
        started = time.monotonic()
        got = fetch_version(server.address, 3, digests[3], tmp_path / "a", Base(2, root / "v2", digests[2]),
                            delta_wait_s=30)
        assert time.monotonic() - started < 10, "the client waited for a builder that is behind"
    assert got.base is None and same_files(got.path, root / "v3")
    assert [(e["waited_s"], e["backlog"]) for e in logs if e["event"] == "weights_delta_not_ready"] == [(0.0, 2)]
    server.add(3, (2, digests[2]))
    assert server.manifests.backlog == 2, "no third build queued behind two"
    held_builds.set()
    built_all(server)


def test_a_client_that_does_not_say_waits_the_servers_default(served, held_builds, tmp_path, monkeypatch):
    server, root, digests = served
    monkeypatch.setattr(server_module, "DELTA_WAIT_S", 0.2)
    with capture_logs() as logs:
        got = fetch_version(server.address, 3, digests[3], tmp_path / "a", Base(2, root / "v2", digests[2]))
    assert got.base is None and same_files(got.path, root / "v3")
    assert [e["waited_s"] for e in logs if e["event"] == "weights_delta_not_ready"] == [0.2]


def test_the_receiver_waits_for_a_delta_as_long_as_its_last_whole_version_took(served, held_builds, tmp_path):
    from rlbus.weights.sync import Receiver
    from tests.weights.test_network import RecordingEngine

    server, root, digests = served
    elsewhere = tmp_path / "not-here"
    receiver, engine = Receiver("e", tmp_path / "fetched", mode="fetch"), RecordingEngine()
    assert receiver.load(engine, state_of(server, root, digests, 1, location=elsewhere / "v1"))
    assert receiver._whole_s is not None and receiver._whole_s > 0
    took = receiver._whole_s
    before = server.served_bytes
    with capture_logs() as logs:
        assert receiver.load(engine, state_of(server, root, digests, 2, location=elsewhere / "v2"))
    assert [e["waited_s"] for e in logs if e["event"] == "weights_delta_not_ready"] == [round(took * 1000) / 1000]
    assert server.served_bytes - before >= (root / "v2" / "model.safetensors").stat().st_size  # whole
    assert same_files(tmp_path / "fetched" / "v2", root / "v2") and engine.version == 2
    # What it waits next is the time the whole version took to arrive, not that plus the wait before it: a wait
    # of 1 s (the small version comes in far less) is not carried over, and waits do not grow fetch by fetch.
    receiver._whole_s = 1.0
    held_builds.set()  # v1 to v2 is built; v2 to v3 will be held, with the builder not behind
    built_all(server)
    held_builds.clear()
    with capture_logs() as logs:
        assert receiver.load(engine, state_of(server, root, digests, 3, location=elsewhere / "v3"))
    assert [e["waited_s"] for e in logs if e["event"] == "weights_delta_not_ready"] == [1.0]
    assert 0 < receiver._whole_s < 1.0
    receiver.close()


def test_an_explorer_told_how_long_to_wait_for_a_delta_waits_that_long(served, held_builds, tmp_path):
    from rlbus.common.config import load_config
    from rlbus.weights.sync import Receiver
    from tests.weights.test_network import RecordingEngine

    assert load_config(None, [], environ={}).explorer.delta_wait_s is None
    told = load_config(None, ["explorer.delta_wait_s=0.4"], environ={}).explorer.delta_wait_s
    assert told == 0.4
    with pytest.raises(Exception, match="delta_wait_s"):
        load_config(None, ["explorer.delta_wait_s=-1"], environ={})
    server, root, digests = served
    elsewhere = tmp_path / "not-here"
    receiver, engine = Receiver("e", tmp_path / "fetched", mode="fetch", delta_wait_s=told), RecordingEngine()
    assert receiver.load(engine, state_of(server, root, digests, 1, location=elsewhere / "v1"))
    with capture_logs() as logs:
        assert receiver.load(engine, state_of(server, root, digests, 2, location=elsewhere / "v2"))
    assert [e["waited_s"] for e in logs if e["event"] == "weights_delta_not_ready"] == [0.4]
    receiver.close()


def test_a_build_that_is_done_before_it_is_counted_is_counted_off(served):
    """A build can finish before the server adds its done-callback, which then runs at once, under the lock the
    server holds while it submits: counting it off must not take that lock again."""
    from concurrent.futures import Future

    server, _, digests = served

    made = server.manifests._build_manifest(2, 1, digests[1])

    class AtOnce:  # an executor whose build is done by the time `submit` returns
        def submit(self, fn, *args):
            future = Future()
            future.set_result(made)
            return future

        def shutdown(self, **_):
            pass

    server.manifests._builder = AtOnce()
    got = []
    asking = threading.Thread(target=lambda: got.append(server.manifests.get(2, 1, digests[1]).result()),
                              daemon=True)
    asking.start()
    asking.join(30)
    assert not asking.is_alive(), "the server deadlocked counting a build off"
    assert got[0]["base"] == 1 and server.manifests.backlog == 0


def test_deltas_that_come_too_late_are_built_for_one_version_in_eight_until_one_comes_in_time(tmp_path):
    from tests.helpers.served import publish_versions

    root = tmp_path / "served"
    digests = publish_versions(root, 12)
    server = WeightServer(root, chunk_bytes=CHUNK_BYTES).start()

    def built() -> list[int]:  # the versions whose delta was built
        return sorted(int(p.name.split(".")[0].partition("-v")[2]) for p in (root / ".deltas").glob("v*-v*"))

    def fetch(version: int, wait_s: float):
        base = Base(version - 1, root / f"v{version - 1}", digests[version - 1])
        return fetch_version(server.address, version, digests[version], tmp_path / f"e{version}", base,
                             delta_wait_s=wait_s)

    try:
        with capture_logs() as logs:
            # A client that waits for no build: v2's and v3's deltas are not ready in time, and the builds pause.
            assert fetch(2, 0).base is None and fetch(3, 0).base is None
            built_all(server)
            assert built() == [2, 3]
            server.add(4, (3, digests[3]))  # published: no delta built ahead either
            for version in range(4, 11):
                got = fetch(version, 0)
                assert got.base is None and same_files(got.path, root / f"v{version}")
            built_all(server)
            assert built() == [2, 3]
            # One version in eight gets its delta built; this client waits for it, takes it, and builds resume.
            assert fetch(11, 30).base == 10
            assert fetch(12, 0).base is None
            built_all(server)
            assert built() == [2, 3, 11, 12]
        assert [e["event"] for e in logs if e["event"].startswith("weights_deltas_")] == \
            ["weights_deltas_paused", "weights_deltas_resumed"]
    finally:
        server.close()

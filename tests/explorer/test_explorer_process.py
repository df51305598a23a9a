"""A real `rlbus explorer` process killed mid-batch loses nothing: its leases go to another explorer."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from rlbus.common import protocol as P
from rlbus.explorer.engine import inline_core
from rlbus.explorer.main import Explorer
from rlbus.logview import events
from tests.conftest import REPO, TINY_KV_MB, reap
from tests.explorer.test_explorer import explorer_config

pytestmark = pytest.mark.slow  # starts engines or trains


def test_explorer_killed_mid_batch_has_its_leases_reissued(broker_factory, clients, engine, tiny_model, tmp_path):
    b = broker_factory("sync.sync_style=async", "sync.max_staleness=100", "rollout.repeat=4", "data.batch_tasks=2",
                       "data.max_tasks=6", "rollout.max_tokens=400")
    tool = clients(b, "tool", "watch")
    args = [sys.executable, "-m", "rlbus.cli", "explorer", "--broker", b.address, "--name", "victim"]
    for s in (f"broker.pub_port={b.pub_port}", "broker.heartbeat_interval_s=0.2", f"model.path={tiny_model}",
              "rollout.dtype=float32", f"explorer.kv_cache_mb={TINY_KV_MB}", "rollout.max_tokens=400",
              "explorer.tasks_per_lease=2", "logging.format=json"):
        args += ["--set", s]
    # Its own session, so the kill takes its vLLM engine processes too, as a dying host would.
    victim = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "victim.log", "w"),
                              start_new_session=True)
    try:
        held = 0
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and victim.poll() is None:
            peers = {p["name"]: p for p in tool.request(P.STATUS).header["peers"]}
            held = peers.get("victim", {}).get("leases", 0)
            if held:
                break
            time.sleep(0.05)
        assert held, f"the victim never held a lease: {(tmp_path / 'victim.log').read_text()[-2000:]}"
        os.killpg(victim.pid, signal.SIGKILL)
        reap(victim)
        status = tool.request(P.STATUS).header
        assert status["buffer"]["stored"] == 0, "killed before it PUT anything"
        # Another explorer picks up the victim's tasks once the broker drops it.
        ex = Explorer(explorer_config(b, "sync.sync_style=async", "rollout.max_tokens=400"), engine, name="rescuer")
        ex.run()  # until the taskset is done
        status = tool.request(P.STATUS).header
        assert status["tasks"]["done"] == 6 and status["tasks"]["leased"] == 0
        assert status["buffer"]["stored"] == 6 * 4
        events = b.log_events()
        assert any(e["event"] == "peer_left" and e["peer"] == "victim" and e["leases_released"] == held
                   for e in events)
    finally:
        _stop_group(victim)  # the group it leads: its engine processes too


def _start_explorer(b, name: str, tmp_path, *sets: str, env: dict | None = None) -> subprocess.Popen:
    """A standalone `rlbus explorer` in a session of its own, logging JSON to tmp_path/NAME.jsonl."""
    args = [sys.executable, "-m", "rlbus.cli", "explorer", "--broker", b.address, "--name", name]
    for s in (f"broker.pub_port={b.pub_port}", "broker.heartbeat_interval_s=0.2", "rollout.dtype=float32",
              f"explorer.kv_cache_mb={TINY_KV_MB}", "rollout.max_tokens=200", "explorer.tasks_per_lease=2",
              "logging.format=json", f"logging.file={tmp_path}/{name}.jsonl", *sets):
        args += ["--set", s]
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{name}.err", "w"),
                            start_new_session=True, env=None if env is None else {**os.environ, **env})


def _wait_for_lease(tool, proc: subprocess.Popen, name: str, tmp_path) -> int:
    deadline = time.monotonic() + 180
    held = 0
    while time.monotonic() < deadline and proc.poll() is None and not held:
        peers = {p["name"]: p for p in tool.request(P.STATUS).header["peers"]}
        held = peers.get(name, {}).get("leases", 0)
        time.sleep(0.05)
    assert held, f"{name} never held a lease: {(tmp_path / f'{name}.err').read_text()[-2000:]}"
    return held


def _events(tmp_path, name: str) -> list[dict]:
    return events(tmp_path / f"{name}.jsonl")


def _stop_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    reap(proc)


def test_sigterm_finishes_the_batch_puts_it_and_says_bye(broker_factory, clients, tiny_model, tmp_path):
    # Silence drops a peer after 5 s here, as with the defaults (1 s x 5), not after the suite's 1 s: this test is
    # about BYE, and an explorer sharing two cores with the rest of the suite can go unscheduled for most of a
    # second (measured with both cores busy: all its threads stalled 0.3-0.7 s at a time, mid-rollout).
    b = broker_factory("sync.sync_style=async", "sync.max_staleness=100", "rollout.repeat=4", "data.batch_tasks=2",
                       "rollout.max_tokens=200", "broker.liveness=25")
    tool = clients(b, "tool", "watch")
    inline = inline_core("auto")
    one_thread = ["explorer.threads=1"] if inline else []  # a core in a process of its own takes no such setting
    # The setting, not the suite's OMP_NUM_THREADS (tests/conftest.py), gives the engine its threads.
    proc = _start_explorer(b, "polite", tmp_path, f"model.path={tiny_model}", *one_thread, env={"OMP_NUM_THREADS": "2"})
    try:
        held = _wait_for_lease(tool, proc, "polite", tmp_path)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(120) == 0
        status = tool.request(P.STATUS).header
        assert "polite" not in {p["name"] for p in status["peers"]}, "it said BYE"
        assert status["tasks"]["leased"] == 0
        assert status["buffer"]["stored"] % 4 == 0 and status["buffer"]["stored"] >= 4 * held, \
            "the batch in hand was finished and PUT"
        events = [e for e in b.log_events() if e["event"] == "peer_left" and e["peer"] == "polite"]
        own = _events(tmp_path, "polite")
        assert events and events[0]["reason"] == "bye", (events, own[-8:])
        started = next(e for e in own if e["event"] == "engine_started")
        assert started["core"] == ("inline" if inline else "process")
        if inline:  # as explorer.threads says (left at 0: torch's, here 2)
            assert started["threads"] == 1
        batches = [e for e in own if e["event"] == "explorer_batch"]
        assert batches and all(0 <= e["core_wait"] <= 1 for e in batches)
        # Started with the collector off, the imports' heap frozen before vLLM built the engine, and frozen again
        # before it joined: no collector stalls.
        frozen = [e for e in own if e["event"] == "heap_frozen"]
        assert frozen[0]["deferred"] and frozen[0]["objects"] > 100_000 and frozen[0]["ts"] < started["ts"]
        assert frozen[1]["ts"] < next(e["ts"] for e in own if e["event"] == "explorer_connected")
        # The process ending, its heap stayed frozen through vLLM's shutdown (which unfreezes it and collects it in
        # full), and what the shutdown made is frozen after it: the interpreter's teardown skips it all.
        assert [e["event"] for e in own if e["event"] in ("engine_stopped", "heap_frozen")][-2:] == \
            ["engine_stopped", "heap_frozen"]
        assert next(e for e in own if e["event"] == "engine_stopped")["frozen"] > 0.9 * frozen[1]["objects"]
        with pytest.raises(ProcessLookupError):  # nothing of its engine outlives it
            os.killpg(proc.pid, 0)
    finally:
        _stop_group(proc)


def _sockets(root) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files
            if stat.S_ISSOCK(os.lstat(os.path.join(d, f)).st_mode)]


def test_sigkilled_explorer_takes_its_engine_processes_and_their_sockets_with_it(broker_factory, clients,
                                                                                 tiny_model, tmp_path):
    """vLLM's engine core in a process of its own (as on GPUs) ends when its explorer is SIGKILLed, and the
    Unix sockets they talked over go too: only the explorer's pid is killed, as the OOM killer or `kill -9`
    would. On CPUs its core, like an inline one, compiles nothing."""
    import psutil

    b = broker_factory("sync.sync_style=async", "sync.max_staleness=100", "rollout.repeat=4", "data.batch_tasks=2",
                       "rollout.max_tokens=200")
    tool = clients(b, "tool", "watch")
    temp = tempfile.mkdtemp(prefix="rl")  # short: a Unix socket's path holds at most 107 bytes
    proc = _start_explorer(b, "doomed", tmp_path, f"model.path={tiny_model}", "explorer.engine_core=process",
                           env={"TMPDIR": temp})
    try:
        _wait_for_lease(tool, proc, "doomed", tmp_path)
        engine = psutil.Process(proc.pid).children(recursive=True)
        assert engine, "the engine core runs in a process of its own"
        assert _sockets(temp), "vLLM's engine sockets are in the explorer's temporary directory"
        # Warmed up (it joined), and its engine core compiled nothing: torch.compile's C++ build of the sampler's
        # one op would have made its cache in the temporary directory (about 17 s of the warm-up).
        assert not [f for f in os.listdir(temp) if f.startswith("torchinductor")], os.listdir(temp)
        os.kill(proc.pid, signal.SIGKILL)
        reap(proc)
        _, alive = psutil.wait_procs(engine, timeout=15)
        assert not alive, f"outlived their explorer: {[(p.pid, p.name()) for p in alive]}"
        assert "rlbus: the explorer" in (tmp_path / "doomed.err").read_text(), "the engine said why it ended"
        assert not _sockets(temp) and not [f for f in os.listdir(temp) if f.startswith("rlbus-")], os.listdir(temp)
    finally:
        _stop_group(proc)
        shutil.rmtree(temp, ignore_errors=True)


def test_sigterm_with_the_broker_gone_too_exits_instead_of_waiting(broker_factory, clients, tiny_model, tmp_path):
    """The whole run stopping at once: the broker is gone when the explorer is told to stop. The explorer
    gives up on the batch it cannot PUT once the broker has been silent for `liveness` heartbeats."""
    b = broker_factory("sync.sync_style=async", "sync.max_staleness=100", "rollout.repeat=4", "data.batch_tasks=2",
                       "rollout.max_tokens=200")
    tool = clients(b, "tool", "watch")
    proc = _start_explorer(b, "stranded", tmp_path, f"model.path={tiny_model}")
    try:
        _wait_for_lease(tool, proc, "stranded", tmp_path)
        b.kill(signal.SIGKILL)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(120) == 0
        own = _events(tmp_path, "stranded")
        assert any(e["event"] == "stopped_without_broker" for e in own)
        assert any(e["event"] == "engine_stopped" for e in own)
    finally:
        _stop_group(proc)

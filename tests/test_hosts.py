"""Separate hosts: broker, trainer and explorers in network namespaces of their own, sharing no files.

They reach each other over real addresses (10.231.x.0/30 links that exist
only inside the namespaces this test makes, routed through the broker's
namespace), not loopback. Each explorer also runs in a mount namespace where
the trainer's run directory is an empty tmpfs, so weights can only arrive
over the network, from the trainer's weight server. Skips with the reason
where namespaces cannot be created (not root, no iproute2).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from rlbus.logview import events
from tests.conftest import REPO, TINY_KV_MB

pytestmark = pytest.mark.slow  # starts engines or trains

ROLES = ("t", "e1", "e2", "e3")  # the broker's host links them all


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture
def hosts():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2 (ip)")
    tag = f"rl{os.getpid() % 100000}"
    names = {role: f"{tag}{role}" for role in ("b", *ROLES)}
    try:
        for ns in names.values():
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        for ns in names.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode().strip()}")
    addresses = {}  # role -> (its own address, where it reaches the broker)
    try:
        sh("ip", "netns", "exec", names["b"], "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for i, role in enumerate(ROLES, start=1):
            a, b = f"{tag}b{role}", f"{tag}{role}b"  # broker side, peer side
            sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            sh("ip", "link", "set", a, "netns", names["b"])
            sh("ip", "link", "set", b, "netns", names[role])
            sh("ip", "-n", names["b"], "addr", "add", f"10.231.{i}.1/30", "dev", a)
            sh("ip", "-n", names[role], "addr", "add", f"10.231.{i}.2/30", "dev", b)
            sh("ip", "-n", names["b"], "link", "set", a, "up")
            sh("ip", "-n", names[role], "link", "set", b, "up")
            sh("ip", "-n", names[role], "route", "add", "10.231.0.0/16", "via", f"10.231.{i}.1")
            addresses[role] = (f"10.231.{i}.2", f"10.231.{i}.1")
        yield names, addresses
    finally:
        for ns in names.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_hosts_that_share_no_files_get_every_version_over_the_network(hosts, tiny_model, tmp_path):
    names, at = hosts
    homes = {role: tmp_path / "hosts" / role for role in ("b", *ROLES)}  # each host's own run directory
    logs = tmp_path / "logs"
    for d in (*homes.values(), logs):
        d.mkdir(parents=True)
    # Versions three steps apart: explorers take deltas against a version three numbers back.
    common = ["--set", f"model.path={tiny_model}", "--set", "rollout.repeat=4", "--set", "data.batch_tasks=2",
              "--set", "sync.sync_interval=3", "--set", "sync.sync_offset=1", "--set", "sync.sync_style=async",
              "--set", "broker.heartbeat_interval_s=0.5", "--set", "logging.format=json",
              "--set", "rollout.dtype=float32", "--set", "rollout.max_tokens=8",
              # The tiny random model earns no reward: every group is all-equal, and a trainer that skipped them
              # would wait algorithm.informative_wait_s (60 s) at every step.
              "--set", "algorithm.skip_zero_spread=false"]
    procs = {}

    def start(role, name, command, *extra):
        argv = [sys.executable, "-m", "rlbus.cli", command, *common, "--set", f"run.dir={homes[role]}/run",
                "--set", f"logging.file={logs}/{name}.jsonl", *extra]
        if role.startswith("e"):  # this host cannot see the trainer's files: an empty tmpfs lies over them
            argv = ["sh", "-c", f'mount -t tmpfs none "{homes["t"]}" && exec "$@"', "explorer-host", *argv]
        procs[name] = subprocess.Popen(["ip", "netns", "exec", names[role], *argv], cwd=REPO,
                                       stdout=subprocess.DEVNULL, stderr=open(logs / f"{name}.err", "w"),
                                       start_new_session=True)

    def fetched(name):
        return events(logs / f"{name}.jsonl", "weights_fetched")

    def explorer(role, name):
        start(role, name, "explorer", "--broker", f"tcp://{at[role][1]}:5555", "--name", name,
              "--set", f"explorer.kv_cache_mb={TINY_KV_MB}",
              # The tiny model's whole version comes quicker than a delta's build: wait for the delta.
              "--set", "explorer.delta_wait_s=10")

    try:
        start("b", "broker", "broker", "--set", "broker.host=0.0.0.0", "--set", "broker.port=5555",
              "--set", "broker.pub_port=5556")
        start("t", "trainer", "trainer", "--broker", f"tcp://{at['t'][1]}:5555", "--set", "trainer.total_steps=1000",
              "--set", "trainer.checkpoint_every=0", "--set", "trainer.micro_batch=4",
              "--set", "trainer.fetch_wait_s=1", "--set", f"sync.serve_host={at['t'][0]}",
              # These "hosts" share two cores with three engines, which leave the trainer no idle CPU for deltas
              # (built at idle priority by default): on hosts of their own the engines would not take it.
              "--set", "sync.serve_delta_priority=normal")
        explorer("e1", "near")
        explorer("e2", "far")
        deadline = time.monotonic() + 420
        newest = lambda name: max((e["policy_version"] for e in fetched(name)), default=0)  # noqa: E731
        while not (len(fetched("near")) >= 2 and newest("far") >= 1):
            assert time.monotonic() < deadline and procs["trainer"].poll() is None, \
                (logs / "trainer.err").read_text()[-2000:]
            time.sleep(1)
        explorer("e3", "late")  # joins a run well under way: a whole version first, then deltas
        while not any(e["base"] is not None for e in fetched("late")):
            assert time.monotonic() < deadline and procs["trainer"].poll() is None, \
                (logs / "late.err").read_text()[-2000:]
            time.sleep(1)
    finally:
        for p in procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(30)
    joined = {e["peer"] for e in events(logs / "broker.jsonl", "peer_joined")}
    assert {"trainer", "near", "far", "late"} <= joined
    assert not list((homes["e1"] / "run").glob("weights/v*")), "the trainer wrote into an explorer's host"
    streamed = 0
    for name in ("near", "far", "late"):
        loads = [e for e in events(logs / f"{name}.jsonl", "weights_loaded")]
        got = fetched(name)
        # Every version this explorer loaded came by fetch, and each fetch was checked and loaded (but the newest,
        # when the explorer was killed between its fetch and its load, or between an overlapped load and the line
        # of the fetch it overlapped).
        loaded, came = {e["policy_version"] for e in loads}, {e["policy_version"] for e in got}
        assert loads and loaded - came <= {max(loaded)} and came - loaded <= {max(came, default=0)}, (loaded, came)
        assert all("/fetched/" in e["path"] for e in loads), loads
        assert all(e["base"] is None or e["bytes"] < e["version_bytes"] for e in got)
        # The first version is reloaded once fetched; from the second on the engine reloads while the fetch
        # arrives (weights/stream.py), from a delta or chunk by chunk.
        assert loads[0]["method"] == "checkpoint" and not got[0]["overlapped"], (loads, got)
        assert all(e["method"] == "stream" for e in loads[1:]) and all(e["overlapped"] for e in got[1:]), (loads, got)
        streamed += len(loads) - 1
    assert streamed >= 1  # the first explorer has fetched two versions
    late = fetched("late")
    assert late[0]["base"] is None and late[0]["policy_version"] >= 2
    assert any(e["base"] is not None for e in late[1:])

"""Separate hosts: broker, trainer and explorer in network namespaces of their own, linked by veth pairs.

They reach each other over real addresses (10.231.x.0/30 links that exist
only inside the namespaces this test makes), not loopback. Skips with the
reason where namespaces cannot be created (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture
def hosts():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2 (ip)")
    tag = f"rl{os.getpid() % 100000}"
    names = {role: f"{tag}{role}" for role in ("b", "t", "e")}
    try:
        for ns in names.values():
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        for ns in names.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode().strip()}")
    addresses = {}
    try:
        for i, role in enumerate(("t", "e"), start=1):
            a, b = f"{tag}b{role}", f"{tag}{role}b"  # broker side, peer side
            sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            sh("ip", "link", "set", a, "netns", names["b"])
            sh("ip", "link", "set", b, "netns", names[role])
            sh("ip", "-n", names["b"], "addr", "add", f"10.231.{i}.1/30", "dev", a)
            sh("ip", "-n", names[role], "addr", "add", f"10.231.{i}.2/30", "dev", b)
            sh("ip", "-n", names["b"], "link", "set", a, "up")
            sh("ip", "-n", names[role], "link", "set", b, "up")
            addresses[role] = f"10.231.{i}.1"  # where that host reaches the broker
        yield names, addresses
    finally:
        for ns in names.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_broker_trainer_and_explorer_on_separate_hosts(hosts, tiny_model, tmp_path):
    names, broker_at = hosts
    run = tmp_path / "run"
    common = ["--set", f"run.dir={run}", "--set", f"model.path={tiny_model}", "--set", "rollout.repeat=4",
              "--set", "data.batch_tasks=2", "--set", "sync.sync_interval=1", "--set", "sync.sync_offset=1",
              "--set", "broker.heartbeat_interval_s=0.5", "--set", "logging.format=json",
              "--set", "rollout.dtype=float32", "--set", "rollout.max_tokens=8"]
    procs = []

    def start(role, command, *extra):
        args = ["ip", "netns", "exec", names[role], sys.executable, "-m", "rlbus.cli", command, *common,
                "--set", f"logging.file={tmp_path}/{command}.jsonl", *extra]
        procs.append(subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL,
                                      stderr=open(tmp_path / f"{command}.err", "w"), start_new_session=True))
        return procs[-1]

    try:
        start("b", "broker", "--set", "broker.host=0.0.0.0", "--set", "broker.port=5555",
              "--set", "broker.pub_port=5556")
        trainer = start("t", "trainer", "--broker", f"tcp://{broker_at['t']}:5555", "--set", "trainer.total_steps=2",
                        "--set", "trainer.checkpoint_every=0", "--set", "trainer.micro_batch=4",
                        "--set", "trainer.fetch_wait_s=1")
        start("e", "explorer", "--broker", f"tcp://{broker_at['e']}:5555", "--name", "far-explorer",
              "--set", "explorer.memory_fraction=0.1")
        assert trainer.wait(400) == 0, (tmp_path / "trainer.err").read_text()[-2000:]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(30)
    broker_log = [json.loads(x) for x in (tmp_path / "broker.jsonl").read_text().splitlines()]
    joined = {e["peer"]: e for e in broker_log if e["event"] == "peer_joined"}
    assert {"trainer", "far-explorer"} <= set(joined)
    steps = [json.loads(x) for x in (tmp_path / "trainer.jsonl").read_text().splitlines() if '"train_step"' in x]
    assert [s["step"] for s in steps] == [0, 1]
    batches = [json.loads(x) for x in (tmp_path / "explorer.jsonl").read_text().splitlines()
               if '"explorer_batch"' in x]
    assert batches and max(b["policy_version"] for b in batches) >= 1, "the far explorer loaded published weights"

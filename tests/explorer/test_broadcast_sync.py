"""`sync_method: nccl` with the gloo backend: a real trainer-side publisher, real vLLM members, real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rlbus.common import protocol as P
from rlbus.common.config import load_config
from rlbus.weights.digest import weights_digest
from rlbus.weights.sync import load_checkpoint
from rlbus.explorer.main import Explorer
from rlbus.logview import events
from tests.conftest import REPO, TINY_KV_MB, reap
from tests.explorer.test_explorer import explorer_config
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.slow  # starts engines or trains


def publisher(tmp_path: Path, base_model: str, timeout_s: float):
    from rlbus.weights.broadcaster import BroadcastSender
    from rlbus.weights.checkpoint import CheckpointSender

    cfg = load_config(None, ["sync.sync_method=nccl", "sync.broadcast_backend=gloo", f"sync.sync_timeout_s={timeout_s}",
                             "sync.bucket_mb=4"], environ={})
    return BroadcastSender(cfg, CheckpointSender(tmp_path / "weights", base_model, dtype=torch.float32),
                              dtype=torch.float32)


def tiny_weights(tmp_path: Path, tiny_model: str, seed: int):
    from transformers import AutoModelForCausalLM

    from rlbus.weights.models import make_tiny

    return AutoModelForCausalLM.from_pretrained(make_tiny(tmp_path / f"w{seed}", tiny_model, seed=seed),
                                                dtype=torch.float32)


def assert_generates_like(engine, model) -> None:
    """The engine's greedy output equals transformers' on `model`'s weights."""
    prompt = engine.chat_prompt([{"role": "user", "content": "Say something."}])
    got = engine.generate([prompt], n=1, temperature=0.0, max_tokens=6)[0][0].token_ids
    want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert got == want[:len(got)]


def peers(tool) -> dict[str, dict]:
    return {p["name"]: p for p in tool.request(P.STATUS).header["peers"]}


def start_explorer(ex: Explorer) -> threading.Thread:
    thread = threading.Thread(target=ex.run, daemon=True)
    thread.start()
    return thread


def tear_down(ex: Explorer, thread: threading.Thread | None, proc: subprocess.Popen, pub, engine,
              tiny_model: str) -> None:
    """Stop the in-process explorer, kill the other process's group (its engine too), and leave the shared
    engine at version 0 on the original weights."""
    ex.stop()
    if thread is not None:
        thread.join(60)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    pub.close()
    load_checkpoint(engine, tiny_model, weights_digest(tiny_model), 0)
    reap(proc)  # last: the shared engine is back on version 0 even if this fails


def test_mixed_fleet_late_joiner_gets_the_checkpoint_then_the_broadcast(broker_factory, clients, engine, tiny_model,
                                                                        tmp_path):
    b = broker_factory("sync.sync_style=async", "sync.max_staleness=100", "rollout.repeat=4", "data.batch_tasks=2")
    trainer = clients(b, "trainer", "tr")
    pub = publisher(tmp_path, tiny_model, timeout_s=60)
    pub.attach(trainer)
    # A checkpoint-only explorer process: outside the broadcast group.
    log_file = tmp_path / "files.jsonl"
    args = [sys.executable, "-m", "rlbus.cli", "explorer", "--broker", b.address, "--name", "files"]
    for s in (f"broker.pub_port={b.pub_port}", "broker.heartbeat_interval_s=0.2", f"model.path={tiny_model}",
              "rollout.dtype=float32", f"explorer.kv_cache_mb={TINY_KV_MB}", "rollout.max_tokens=8",
              "explorer.tasks_per_lease=2", "explorer.receive=checkpoint", "logging.format=json",
              f"logging.file={log_file}"):
        args += ["--set", s]
    files = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "files.err", "w"),
                             start_new_session=True)
    ex = Explorer(explorer_config(b, "sync.sync_style=async"), engine, name="late")
    thread = None
    try:
        wait_for(lambda: "files" in peers(trainer) or files.poll() is not None, 240, "the file explorer to connect")
        assert files.poll() is None, (tmp_path / "files.err").read_text()[-2000:]
        assert peers(trainer)["files"]["capabilities"]["sync_methods"] == ["checkpoint"]

        # Version 1: nobody can receive a broadcast, so it is a checkpoint only.
        trainer.request(P.PUBLISH, pub.publish(pub.snapshot(tiny_weights(tmp_path, tiny_model, 1)), 1, 0))
        assert pub.epoch == 0

        # A broadcast-capable explorer joins between syncs: the checkpoint first...
        thread = start_explorer(ex)
        wait_for(lambda: engine.version == 1, 60, "the late joiner to load version 1")
        assert engine.last_load["method"] == "checkpoint"

        # ...then the next version by broadcast, in a new epoch that has it as its only member.
        model2 = tiny_weights(tmp_path, tiny_model, 2)
        state = pub.publish(pub.snapshot(model2), 2, 1)
        assert pub.epoch == 1 and pub.members == (("late", 1),)
        wait_for(lambda: engine.version == 2, 30, "the member to load version 2")
        assert engine.last_load["method"] == "nccl"
        trainer.request(P.PUBLISH, state)
        assert state["method"] == "nccl" and Path(state["location"]).is_dir()

        def loaded(version):
            return any(e.get("policy_version") == version for e in events(log_file, "weights_loaded"))
        wait_for(lambda: loaded(2), 60, "the file explorer to load version 2 from the checkpoint")

        ex.stop()
        thread.join(60)
        assert_generates_like(engine, model2)  # the broadcast weights really are the ones generating
    finally:
        tear_down(ex, thread, files, pub, engine, tiny_model)


def trainer_and_victim(broker_factory, clients, tiny_model: str, tmp_path: Path, timeout_s: float):
    """A broker, the trainer's publisher attached to it, and a victim member in a process of its own (in its own
    session) that touches the returned marker once it has received its first bucket, then receives no more."""
    b = broker_factory("sync.sync_style=async", "sync.max_staleness=100", "rollout.repeat=4", "data.batch_tasks=2")
    trainer = clients(b, "trainer", "tr")
    pub = publisher(tmp_path, tiny_model, timeout_s=timeout_s)
    pub.attach(trainer)
    marker = tmp_path / "first_bucket"
    victim = subprocess.Popen([sys.executable, "-m", "tests.helpers.bcast_member", b.address, b.bus, "victim",
                               str(marker)], cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / "victim.err", "w"), start_new_session=True)
    return b, trainer, pub, victim, marker


def publish_first_version(pub, tmp_path: Path, tiny_model: str, marker: Path) -> tuple[threading.Thread, dict]:
    """Publish version 1 on a thread (its result goes into the returned dict as `state`), once the victim has
    received its first bucket (`marker`)."""
    box: dict = {}
    weights = tiny_weights(tmp_path, tiny_model, 1)
    publishing = threading.Thread(target=lambda: box.update(state=pub.publish(pub.snapshot(weights), 1, 0)),
                                  daemon=True)
    publishing.start()
    wait_for(marker.exists, 60, "the victim to receive its first bucket")
    return publishing, box


def test_a_member_stopped_mid_broadcast_is_given_up_once_the_broker_drops_it(broker_factory, clients, engine,
                                                                             tiny_model, tmp_path):
    # A stopped member, or one whose host left the network, keeps its connections open, and gloo would wait out
    # the whole timeout for it. The broker drops it once it has been silent for its liveness (5 x 0.2 s here).
    # The survivor, waiting for a bucket of the epoch the trainer gave up on, leaves it too.
    timeout_s = 300.0
    b, trainer, pub, victim, marker = trainer_and_victim(broker_factory, clients, tiny_model, tmp_path, timeout_s)
    ex = Explorer(explorer_config(b, "sync.sync_style=async"), engine, name="survivor")
    thread = start_explorer(ex)
    try:
        wait_for(lambda: {"victim", "survivor"} <= set(peers(trainer)), 60, "both members to connect")
        publishing, box = publish_first_version(pub, tmp_path, tiny_model, marker)
        os.killpg(victim.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        publishing.join(timeout_s / 2)
        assert not publishing.is_alive(), "the trainer waits out the timeout for a stopped member"
        assert time.monotonic() - stopped < timeout_s / 4
        assert pub.comm is None and "victim" in pub.suspects, "the epoch was not aborted"
        assert pub.epoch_kv.check(["aborted"])  # what tells members still waiting in it (tests/common)
        trainer.request(P.PUBLISH, box["state"])
        wait_for(lambda: engine.version == 1, 60, "the survivor to reach version 1")

        # The next version goes by broadcast to the survivor in a new epoch, without waiting for the old one's end.
        state = pub.publish(pub.snapshot(tiny_weights(tmp_path, tiny_model, 2)), 2, 1)
        assert pub.members == (("survivor", 1),) and pub.epoch == 2
        wait_for(lambda: engine.version == 2, 60, "the survivor to load version 2")
        assert engine.last_load["method"] == "nccl"
        trainer.request(P.PUBLISH, state)
    finally:
        tear_down(ex, thread, victim, pub, engine, tiny_model)


def test_member_killed_mid_broadcast_does_not_hang_the_trainer(broker_factory, clients, engine, tiny_model, tmp_path):
    timeout_s = 10.0
    b, trainer, pub, victim, marker = trainer_and_victim(broker_factory, clients, tiny_model, tmp_path, timeout_s)
    ex = Explorer(explorer_config(b, "sync.sync_style=async"), engine, name="survivor")
    thread = start_explorer(ex)
    try:
        wait_for(lambda: {"victim", "survivor"} <= set(peers(trainer)), 60, "both members to connect")
        publishing, box = publish_first_version(pub, tmp_path, tiny_model, marker)
        os.killpg(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        reap(victim)
        publishing.join(timeout_s + 30)
        assert not publishing.is_alive(), "the trainer hangs on a dead member"
        assert time.monotonic() - killed < timeout_s + 15
        assert pub.comm is None and "victim" in pub.suspects, "the epoch was not aborted"
        # The checkpoint of that version is published all the same; the survivor ends up on it either way.
        trainer.request(P.PUBLISH, box["state"])
        wait_for(lambda: engine.version == 1, timeout_s + 30, "the survivor to reach version 1")

        # The broker drops the dead member; the next version opens a new epoch without it, and arrives.
        wait_for(lambda: "victim" not in peers(trainer), 30, "the broker to drop the victim")
        state = pub.publish(pub.snapshot(tiny_weights(tmp_path, tiny_model, 2)), 2, 1)
        assert pub.members == (("survivor", 1),) and pub.epoch == 2
        wait_for(lambda: engine.version == 2, 30, "the survivor to load version 2")
        assert engine.last_load["method"] == "nccl"
        trainer.request(P.PUBLISH, state)
    finally:
        tear_down(ex, thread, victim, pub, engine, tiny_model)

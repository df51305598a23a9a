"""Resume: a trainer SIGKILLed after step k continues from its checkpoint and ends with the same weights."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from rlbus.common import protocol as P
from rlbus.logview import events
from tests.conftest import REPO, reap
from tests.trainer.test_trainer import synthetic

pytestmark = pytest.mark.slow  # starts engines or trains

STEPS = 6


def start_trainer(b, run_dir, tiny_model, log_path, steps=STEPS, checkpoint_every=2, *extra, stderr=None, env=None,
                  launcher=(sys.executable, "-m")):
    args = [*launcher, "rlbus.cli", "trainer", "--broker", b.address]
    for s in ("broker.heartbeat_interval_s=0.2", f"run.dir={run_dir}", f"model.path={tiny_model}",
              "rollout.repeat=4", "data.batch_tasks=2", "sync.sync_style=async", "sync.max_staleness=100",
              "trainer.lr=1e-3", "trainer.micro_batch=3", f"trainer.total_steps={steps}", f"trainer.checkpoint_every={checkpoint_every}",
              "trainer.fetch_wait_s=1", "trainer.threads=1", "rollout.dtype=float32", "logging.format=json",
              f"logging.file={log_path}", *extra):
        args += ["--set", s]
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr or subprocess.DEVNULL,
                            env={**os.environ, **env} if env else None)


def steps_logged(path):
    return [e["step"] for e in events(path, "train_step")]


def kill_when(proc, condition, timeout: float = 300) -> None:
    """SIGKILL the trainer as soon as `condition()` holds (it must not exit before)."""
    try:
        deadline = time.monotonic() + timeout
        while not condition() and time.monotonic() < deadline:
            assert proc.poll() is None, "trainer exited early"
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        reap(proc)


def wait_connected(b, clients, proc, timeout: float = 120) -> None:
    """Until the broker lists the trainer `proc` among its peers."""
    watch = clients(b, "tool", "watch")
    deadline = time.monotonic() + timeout
    while "trainer" not in {p["name"] for p in watch.request(P.STATUS).header["peers"]}:
        assert proc.poll() is None and time.monotonic() < deadline, "the trainer did not connect"
        time.sleep(0.2)


def delivered(b):
    db = sqlite3.connect(b.data_dir / "buffer.sqlite3")
    rows = {step: P.unpack(groups) for step, groups in db.execute("SELECT step, groups FROM batches ORDER BY step")}
    db.close()
    return rows


def feed(b, clients, steps=STEPS):
    ex = clients(b, "explorer", "feeder")
    for g in range(2 * steps):
        ex.put(synthetic(f"g{g}", batch=g // 2, seed=7), timeout=10)


def test_sigkill_and_resume_gives_the_weights_of_an_uninterrupted_run(broker_factory, clients, tiny_model, tmp_path):
    sets = ("sync.sync_style=async", "sync.max_staleness=100", "rollout.repeat=4", "data.batch_tasks=2")
    # The uninterrupted run.
    a = broker_factory(*sets)
    feed(a, clients)
    proc = start_trainer(a, tmp_path / "a", tiny_model, tmp_path / "a.jsonl")
    assert proc.wait(300) == 0
    # The same data, a trainer killed after step 4 (its last checkpoint covers step 3), then restarted.
    b = broker_factory(*sets)
    feed(b, clients)
    proc = start_trainer(b, tmp_path / "b", tiny_model, tmp_path / "b.jsonl")
    kill_when(proc, lambda: 4 in steps_logged(tmp_path / "b.jsonl"))
    proc = start_trainer(b, tmp_path / "b", tiny_model, tmp_path / "b.jsonl")
    assert proc.wait(300) == 0
    logged = steps_logged(tmp_path / "b.jsonl")
    assert logged[:5] == [0, 1, 2, 3, 4] and logged[5:] == [4, 5], "resumed at step 4, from the step-3 checkpoint"
    resumed = events(tmp_path / "b.jsonl", "trainer_resumed")
    assert resumed and resumed[0]["step"] == 4
    # The same batch for every step, each group in exactly one step: nothing trained twice.
    assert delivered(a) == delivered(b)
    groups = [g for gs in delivered(b).values() for g in gs]
    assert len(groups) == len(set(groups)) == 2 * STEPS
    wa = load_file(tmp_path / "a" / "weights" / f"v{STEPS}" / "model.safetensors")
    wb = load_file(tmp_path / "b" / "weights" / f"v{STEPS}" / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "bitwise equal final weights"
    w0 = load_file(os.path.join(tiny_model, "model.safetensors"))
    assert any(not torch.equal(wa[k], w0[k]) for k in wa), "training changed the weights"


def test_a_finished_run_checkpoints_and_commits_its_last_step(broker_factory, clients, tiny_model, tmp_path):
    """Three steps, a checkpoint and a version every two: the last step (2) is saved, COMMITted and its version (3)
    published as the run ends, so a finished run's final state (optimizer and all) is on disk, its final weights
    are where explorers and evaluations find them, and a trainer started on it again trains nothing."""
    b = broker_factory("sync.sync_style=async", "sync.max_staleness=100", "rollout.repeat=4", "data.batch_tasks=2")
    feed(b, clients, steps=3)
    log_path = tmp_path / "t.jsonl"
    assert start_trainer(b, tmp_path / "run", tiny_model, log_path, 3, 2, "sync.sync_interval=2").wait(300) == 0
    assert [e["policy_version"] for e in events(log_path, "weights_published")] == [2, 3]
    assert (tmp_path / "run" / "weights" / "v3" / "model.safetensors").exists()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000001",
                                                                                    "step_00000002"]
    db = sqlite3.connect(b.data_dir / "buffer.sqlite3")
    committed = [step for step, done in db.execute("SELECT step, committed FROM batches ORDER BY step") if done]
    db.close()
    assert committed == [0, 1, 2]
    assert start_trainer(b, tmp_path / "run", tiny_model, log_path, 3).wait(300) == 0
    assert steps_logged(log_path) == [0, 1, 2]
    assert [e["step"] for e in events(log_path, "trainer_resumed")] == [3]


def test_trainer_killed_two_steps_after_its_checkpoint_resumes_and_finishes(broker_factory, clients, tiny_model,
                                                                           tmp_path):
    """The broker announced a version newer than the checkpoint's: the resumed trainer skips publishing up to it
    instead of failing on `conflict` at every restart."""
    steps = 8
    b = broker_factory("sync.sync_style=async", "sync.max_staleness=100", "rollout.repeat=4", "data.batch_tasks=2")
    feed(b, clients, steps)
    log_path = tmp_path / "t.jsonl"
    proc = start_trainer(b, tmp_path / "run", tiny_model, log_path, steps, checkpoint_every=4)
    tool = clients(b, "tool", "watch")
    # Steps 4 and 5 done, version 6 announced; the newest checkpoint covers step 3 (the next one, step 7).
    kill_when(proc, lambda: tool.request(P.STATUS).header["weights"]["version"] >= 6)
    announced = tool.request(P.STATUS).header["weights"]["version"]
    assert 6 <= announced <= 7
    proc = start_trainer(b, tmp_path / "run", tiny_model, log_path, steps, checkpoint_every=4)
    assert proc.wait(300) == 0, "the resumed trainer finishes the run"
    assert [e["step"] for e in events(log_path, "trainer_resumed")] == [4]
    skipped = [e["policy_version"] for e in events(log_path, "publish_skipped")]
    assert skipped and max(skipped) <= announced
    published = events(log_path, "weights_published")
    assert published and all(e.get("component") == "trainer" and e.get("peer") == "trainer" for e in published), \
        "events of the publishing thread carry the trainer's context"
    # Each start ran with the collector off until its heap was frozen (rlbus.cli turns it off first).
    assert [e["deferred"] for e in events(log_path, "heap_frozen")] == [True, True]
    assert tool.request(P.STATUS).header["weights"]["version"] == steps
    groups = [g for gs in delivered(b).values() for g in gs]
    assert len(groups) == len(set(groups)) == 2 * steps, "each group in exactly one step"


def test_trainer_waits_out_a_broker_outage_longer_than_its_request_timeout(broker_factory, clients, tiny_model,
                                                                           tmp_path):
    """The broker is SIGKILLed and stays down for several request timeouts: the trainer waits, logs it,
    and finishes the run once the broker is back on the same data."""
    steps = 4
    b = broker_factory("sync.sync_style=async", "sync.max_staleness=100", "rollout.repeat=4", "data.batch_tasks=2")
    log_path = tmp_path / "t.jsonl"
    args = [sys.executable, "-m", "rlbus.cli", "trainer", "--broker", b.address]
    for s in ("broker.heartbeat_interval_s=0.2", f"run.dir={tmp_path / 'run'}", f"model.path={tiny_model}",
              "rollout.repeat=4", "data.batch_tasks=2", "sync.sync_style=async", "sync.max_staleness=100",
              "trainer.micro_batch=4", f"trainer.total_steps={steps}", "trainer.checkpoint_every=0",
              "trainer.fetch_wait_s=0.5", "trainer.broker_timeout_s=1", "trainer.threads=1",
              "rollout.dtype=float32", "logging.format=json", f"logging.file={log_path}"):
        args += ["--set", s]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_connected(b, clients, proc)
        deadline = time.monotonic() + 120
        b.kill(signal.SIGKILL)  # the trainer is connected and waiting for data: take the broker away
        while "broker_unreachable_waiting" not in events_of(log_path):
            assert proc.poll() is None, "the trainer exited while the broker was away"
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(3)  # three more request timeouts
        assert proc.poll() is None, "the trainer exited while the broker was away"
        b.start()
        feed(b, clients, steps)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            reap(proc)
    assert steps_logged(log_path) == list(range(steps))


def events_of(path) -> list[str]:
    return [e["event"] for e in events(path)]


def test_a_trainer_that_fails_says_why_in_its_log(broker_factory, tmp_path):
    b = broker_factory()
    log_path = tmp_path / "t.jsonl"
    args = [sys.executable, "-m", "rlbus.cli", "trainer", "--broker", b.address, "--set",
            f"model.path={tmp_path / 'no-such-model'}", "--set", f"run.dir={tmp_path / 'run'}", "--set",
            "logging.format=json", "--set", f"logging.file={log_path}"]
    proc = subprocess.run(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    assert proc.returncode != 0
    failed = events(log_path, "trainer_failed")
    # A setting it cannot use (ConfigError) is said in one line; any other failure comes with its traceback.
    assert failed and failed[0]["component"] == "trainer" and "no-such-model" in failed[0]["error"]


def test_a_trainer_stopped_while_the_broker_holds_its_fetch_exits_without_waiting_it_out(broker_factory, clients,
                                                                                          tiny_model, tmp_path):
    """No explorer, so the broker holds the trainer's FETCH for data (60 s here, `trainer.fetch_wait_s`): SIGTERM
    ends that wait and the trainer exits 0, having trained nothing."""
    b = broker_factory("sync.sync_style=async", "sync.max_staleness=100", "rollout.repeat=4", "data.batch_tasks=2")
    log_path = tmp_path / "t.jsonl"
    proc = start_trainer(b, tmp_path / "run", tiny_model, log_path, STEPS, 0, "trainer.fetch_wait_s=60")
    try:
        wait_connected(b, clients, proc)
        time.sleep(1)  # its first FETCH is on its way and held
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0  # the held FETCH alone would have taken 60 s
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            reap(proc)
    assert [e["step"] for e in events(log_path, "trainer_stopped")] == [0]

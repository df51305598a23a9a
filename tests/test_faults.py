"""A whole run under faults: explorers, the trainer and the broker SIGKILLed and restarted at seeded points.

A broker, a trainer and three explorers (tiny model, fully async,
`max_staleness` 2, a checkpoint every 3 steps) run as separate processes.
A newcomer explorer starts as the run does and joins as it comes; at given
steps the test kills and restarts the trainer one step after its newest
checkpoint and, later, two steps after it, between the two an explorer drawn
by a seeded generator (back under its old name), and the broker, which stays
away for longer than the trainer's request timeout. Then,
from the logs and the buffer: the run finishes; no trained sample was staler
than the bound; no group is in two committed steps; every stored trajectory
is committed, retired or still waiting (nothing ACKed is lost); and no
process of the run is left.
"""

from __future__ import annotations

import os
from collections import Counter
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbus.broker.store import Store
from rlbus.common import protocol as P
from rlbus.logview import events
from tests.conftest import REPO, TINY_KV_MB

STEPS = 16
STALENESS = 2
CHECKPOINT_EVERY = 3  # checkpoints cover steps 2, 5, 8, 11, ...


class Proc:
    """One component in its own session (so a kill takes its vLLM engine processes too)."""

    def __init__(self, args: list[str], log: Path):
        self.args, self.log = args, log
        self.popen: subprocess.Popen | None = None
        self.started: list[subprocess.Popen] = []

    def start(self) -> "Proc":
        self.popen = subprocess.Popen(self.args, cwd=REPO, stdout=subprocess.DEVNULL,
                                      stderr=open(self.log, "a"), start_new_session=True)
        self.started.append(self.popen)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal every process group this component ever had, and wait until each group is empty
        (the vLLM engine processes too); SIGKILL whatever is left after 30 s."""
        for p in self.started:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        for p in self.started:
            if not group_gone(p, 30):
                os.killpg(p.pid, signal.SIGKILL)
                group_gone(p, 10)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


def group_gone(p: subprocess.Popen, timeout: float) -> bool:
    """Reap the leader and wait for its process group to empty."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p.poll()
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def cli(component: str, run: Path, ports: tuple[int, int], *extra: str) -> list[str]:
    sets = [f"run.dir={run}", f"buffer.dir={run / 'buffer'}", f"broker.port={ports[0]}", f"broker.pub_port={ports[1]}",
            "broker.host=127.0.0.1", f"broker.address=tcp://127.0.0.1:{ports[0]}", "broker.heartbeat_interval_s=0.2",
            "broker.liveness=5", "broker.lease_timeout_s=20", "sync.sync_style=async",
            f"sync.max_staleness={STALENESS}", "rollout.repeat=4", "data.batch_tasks=2", f"trainer.total_steps={STEPS}",
            f"trainer.checkpoint_every={CHECKPOINT_EVERY}", "trainer.micro_batch=8", "trainer.fetch_wait_s=0.5",
            "trainer.broker_timeout_s=1", "trainer.threads=1", "rollout.dtype=float32",
            f"explorer.kv_cache_mb={TINY_KV_MB}", "rollout.max_tokens=48", "explorer.tasks_per_lease=2",
            "explorer.eval_every=0", "algorithm.skip_zero_spread=false", "logging.format=json", *extra]
    return [sys.executable, "-m", "rlbus.cli", component, *[x for s in sets for x in ("--set", s)]]


def wait_until(what: str, check, procs: list[Proc], timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            tails = {p.log.name: p.log.read_text()[-1500:] for p in procs if p.log.exists()}
            raise AssertionError(f"timed out waiting for {what}: {tails}")
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_run_survives_kills_of_every_component(tiny_model, tmp_path):
    from tests.conftest import free_port

    rng = random.Random(11)
    run = tmp_path / "run"
    logs = run / "logs"
    logs.mkdir(parents=True)
    ports = (free_port(), free_port())
    model = f"model.path={tiny_model}"
    broker = Proc(cli("broker", run, ports, f"logging.file={logs / 'broker.jsonl'}"), tmp_path / "broker.err")
    trainer_log = logs / "trainer.jsonl"
    trainer = Proc(cli("trainer", run, ports, model, f"logging.file={trainer_log}"), tmp_path / "trainer.err")

    def explorer(name: str) -> Proc:
        args = cli("explorer", run, ports, model, f"logging.file={logs / (name + '.jsonl')}") + ["--name", name]
        return Proc(args, tmp_path / f"{name}.err")

    explorers = {n: explorer(n) for n in ("ex-a", "ex-b", "ex-c")}
    everyone = [broker, trainer, *explorers.values()]
    steps = lambda: [e["step"] for e in events(trainer_log, "train_step")]  # noqa: E731
    try:
        broker.start()
        wait_until("the broker", lambda: (run / "buffer" / "endpoints.json").exists(), everyone)
        for p in explorers.values():
            p.start()
        # The trainer starts once every explorer has joined, so the faults land mid-run.
        joined = lambda: {e["peer"] for e in events(logs / "broker.jsonl", "peer_joined")}  # noqa: E731
        wait_until("the explorers", lambda: set(explorers) <= joined(), everyone, timeout=180)
        trainer.start()
        # The faults, each once the trainer has logged a given step (the explorer killed is drawn from a
        # seeded generator). A newcomer starts first: its engine takes about as long to start as ten steps
        # take here, so it joins mid-run, among the faults. The trainer is killed one step (step 3, checkpoint 2)
        # and two steps (step 7, checkpoint 5) past a checkpoint; an explorer between the two, and the broker
        # last. The killed explorer comes back under its old name while the run goes on (or once it is over:
        # its engine starts at its own pace).
        plan = [(1, "newcomer"), (3, "trainer"), (5, "explorer"), (7, "trainer"), (9, "broker")]
        victim, restarted = rng.choice(["ex-a", "ex-b", "ex-c"]), 0.0  # one that is generating (not the newcomer)
        for at, fault in plan:
            wait_until(f"step {at}", lambda: len(steps()) and max(steps()) >= at, everyone)
            if fault == "explorer":
                explorers[victim].kill()
                restarted = time.time()
                explorers[victim].start()  # under its old name
            elif fault == "broker":
                broker.kill()
                time.sleep(4)  # longer than the trainer's request timeout (1 s) and the peers' liveness window
                broker.start()
            elif fault == "newcomer":
                explorers["ex-d"] = explorer("ex-d").start()
                everyone.append(explorers["ex-d"])
            else:
                trainer.kill()
                trainer.start()
        wait_until("the trainer to finish", lambda: not trainer.alive(), everyone, timeout=240)
        assert trainer.popen.returncode == 0, (tmp_path / "trainer.err").read_text()[-3000:]
        wait_until("the newcomer", lambda: "ex-d" in joined(), everyone)
        wait_until(f"{victim} to come back", lambda: any(
            e["peer"] == victim and e["ts"] > restarted for e in events(logs / "broker.jsonl", "peer_joined")),
            everyone)
        for p in explorers.values():
            p.kill(signal.SIGTERM)
        broker.kill(signal.SIGTERM)
    finally:
        for p in everyone:
            p.kill()
    # Every process of the run, engines included, is gone (each group emptied after its last signal).
    assert all(group_gone(popen, 0.1) for p in everyone for popen in p.started)

    train_steps = events(trainer_log, "train_step")
    assert sorted({e["step"] for e in train_steps}) == list(range(STEPS)), "the run finished every step"
    worst = max((int(k) for e in train_steps for k in e["staleness"]), default=0)
    assert worst <= STALENESS, f"a step trained on data {worst} versions old"
    # Each restart resumed from the checkpoint before the kill: one and two steps were trained again.
    resumed = [e["step"] for e in events(trainer_log, "trainer_resumed")]
    assert len(resumed) == 2 and all(r % CHECKPOINT_EVERY == 0 for r in resumed), resumed
    redone = [n - 1 for n in Counter(e["step"] for e in train_steps).values() if n > 1]
    assert sum(redone) >= 2, "the kills landed past a checkpoint"
    db = sqlite3.connect(run / "buffer" / "buffer.sqlite3")
    committed = [g for (groups,) in db.execute("SELECT groups FROM batches WHERE committed=1")
                 for g in P.unpack(groups)]
    db.close()
    assert len(committed) == len(set(committed)), "a group was in two committed steps"
    store = Store(run / "buffer", cache_bytes=0)
    try:
        stored = sum(len(g.trajs) for g in store.groups.values())
        c = store.counts
        assert stored == c["stored"]
        assert c["committed"] + c["expired"] + c["skipped"] + store.depth == stored, "a stored trajectory is lost"
        for g in store.groups.values():
            for t in g.trajs:
                store.payload(t)  # every payload is readable and passes its CRC
    finally:
        store.close()
    names = {e["peer"] for e in events(logs / "broker.jsonl", "peer_joined") if e["role"] == "explorer"}
    assert names == {"ex-a", "ex-b", "ex-c", "ex-d"}
    assert len(events(logs / "broker.jsonl", "broker_ready")) == 2, "the broker was restarted once"
    made = sum(e["samples"] for n in names for e in events(logs / f"{n}.jsonl", "explorer_batch"))
    print(f"fault run: {c['expired']} of {made} generated samples expired unused ({c['expired'] / made:.1%}), "
          f"{c['committed']} trained")

"""The trainer on two ranks (FSDP2 over gloo, `trainer.world_size: 2`): the single process's steps, checkpoints
that resume at either world size, and a rank that dies stopping the trainer, which a restart resumes."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlbus.common import protocol as P
from rlbus.logview import events
from rlbus.weights.models import make_tiny
from tests.conftest import REPO, free_port, reap
from tests.helpers.weights import assert_same_weights
from tests.trainer.test_resume import delivered, feed, start_trainer, steps_logged
from tests.trainer.test_trainer import synthetic

pytestmark = pytest.mark.slow  # starts engines or trains

SETS = ("sync.sync_style=async", "sync.max_staleness=100", "rollout.repeat=4", "data.batch_tasks=2")
METRICS = ("loss", "grad_norm", "entropy", "clip_fraction", "forward_tokens")
# Two passes of three optimizer steps over each batch of 8 (mini-batches of 3, 3 and 2, a micro-batch each): the
# proximal forward before the first step, and a rank with no micro-batch of its own in every mini-batch.
UPDATES = ("algorithm.epochs=2", "algorithm.mini_batches=3")


def train(b, run_dir, tiny_model, log, world: int, steps: int, checkpoint_every: int = 2, *extra,
          env: dict | None = None, torchrun: bool = False) -> None:
    """A trainer run to its end: `rlbus trainer` (which starts the ranks), or torchrun starting them."""
    err = open(f"{log}.err", "wb")
    launcher = (str(Path(sys.executable).with_name("torchrun")), f"--nproc-per-node={world}",
                f"--master-port={free_port()}", "-m") if torchrun else (sys.executable, "-m")
    proc = start_trainer(b, run_dir, tiny_model, log, steps, checkpoint_every, f"trainer.world_size={world}",
                         *UPDATES, *extra, stderr=err, env=env, launcher=launcher)
    assert proc.wait(300) == 0, open(f"{log}.err", errors="replace").read()[-3000:]


def step_metrics(log, step: int) -> dict:
    return next(e for e in reversed(events(log, "train_step")) if e["step"] == step)


def assert_same_step(got: dict, want: dict) -> None:
    """Equal to 1e-5, beyond the 5 significant digits the step's log line keeps (one unit in the last)."""
    for k in METRICS:
        logged = 10 ** (math.floor(math.log10(abs(want[k]))) - 4) if want[k] else 0.0
        assert abs(got[k] - want[k]) <= 1e-5 + logged, (k, got[k], want[k])


def test_two_ranks_train_the_single_process_steps_and_resume_at_either_world_size(broker_factory, clients,
                                                                                    tiny_model, tmp_path):
    # Three steps on one process and on two ranks, on the same batches; a checkpoint covers steps 0-1, so the
    # broker re-delivers step 2 to whichever trainer resumes.
    one, two = broker_factory(*SETS), broker_factory(*SETS)
    for b in (one, two):
        feed(b, clients, steps=3)
    train(one, tmp_path / "one", tiny_model, tmp_path / "one.jsonl", world=1, steps=3)
    train(two, tmp_path / "two", tiny_model, tmp_path / "two.jsonl", world=2, steps=3)
    assert delivered(one) == delivered(two), "the same batch for every step"
    assert steps_logged(tmp_path / "one.jsonl") == steps_logged(tmp_path / "two.jsonl") == [0, 1, 2]
    for step in range(3):
        assert_same_step(step_metrics(tmp_path / "two.jsonl", step), step_metrics(tmp_path / "one.jsonl", step))
    w1 = load_file(tmp_path / "one" / "weights" / "v3" / "model.safetensors")
    w2 = load_file(tmp_path / "two" / "weights" / "v3" / "model.safetensors")  # gathered from the shards
    assert_same_weights(w2, w1, lr=1e-3)
    w0 = load_file(os.path.join(tiny_model, "model.safetensors"))
    assert any(not torch.equal(w1[k], w0[k]) for k in w1), "training changed the weights"
    for step in (1, 2):  # every checkpoint_every (2) steps, and the run's last step
        sharded = tmp_path / "two" / "checkpoints" / f"step_{step:08d}"
        assert (sharded / "meta.pt").exists() and list((sharded / "shards").glob("*.distcp"))
        assert (tmp_path / "one" / "checkpoints" / f"step_{step:08d}" / "state.pt").exists()

    # Step 2 again, resumed: the two ranks' sharded checkpoint at two ranks (started by torchrun, as on several
    # hosts) and at one, and the single process's checkpoint at two ranks. The last step's checkpoint goes, as
    # if the trainer had died before it; the broker delivers the step's batch again, committed or not.
    want = step_metrics(tmp_path / "one.jsonl", 2)
    for run in ("one", "two"):
        shutil.rmtree(tmp_path / run / "checkpoints" / "step_00000002")
    shutil.copytree(tmp_path / "two", tmp_path / "two-at-one")
    shutil.copytree(tmp_path / "one", tmp_path / "one-at-two")
    for run, world, torchrun in (("two", 2, True), ("two-at-one", 1, False), ("one-at-two", 2, False)):
        # Step 2 was committed with its checkpoint: each resume takes it from a broker of its own holding it.
        b = broker_factory(*SETS)
        ex = clients(b, "explorer", "feeder")
        for g in (4, 5):  # step 2's two groups, as `feed` made them
            ex.put(synthetic(f"g{g}", batch=g // 2, seed=7), timeout=10)
        log = tmp_path / f"{run}.resumed.jsonl"
        train(b, tmp_path / run, tiny_model, log, world=world, steps=3, torchrun=torchrun)
        assert delivered(b)[2] == delivered(one)[2], "step 2's batch, its groups in the same order"
        assert [e["step"] for e in events(log, "trainer_resumed")] == [2], run
        assert steps_logged(log) == [2], run
        assert_same_step(step_metrics(log, 2), want)


def test_a_rank_killed_mid_run_stops_the_trainer_naming_it_and_a_restart_resumes(broker_factory, clients,
                                                                                   tiny_model, tmp_path):
    b = broker_factory(*SETS)
    feed(b, clients, steps=6)
    log = tmp_path / "trainer.jsonl"
    err = tmp_path / "trainer.err"
    proc = start_trainer(b, tmp_path / "run", tiny_model, log, 6, 2, "trainer.world_size=2", stderr=open(err, "wb"))
    try:
        deadline = time.monotonic() + 300
        while 2 not in steps_logged(log):  # past the first checkpoint (steps 0-1)
            assert time.monotonic() < deadline and proc.poll() is None, err.read_text()[-3000:]
            time.sleep(0.02)
        pids = events(log, "trainer_ranks_started")[0]["pids"]
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        code = proc.wait(60)
        stopped_s = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            reap(proc)
    assert code == 1
    failed = events(log, "trainer_rank_failed")
    assert [(e["rank"], e["reason"]) for e in failed] == [(1, "killed by SIGKILL")]
    assert "trainer rank 1" in err.read_text()
    # Within the bound: the supervisor notices at once and gives the others STOP_GRACE_S (5 s) before SIGKILL.
    assert stopped_s < 15, stopped_s
    for pid in pids:  # no rank is left behind
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"

    train(b, tmp_path / "run", tiny_model, log, world=2, steps=6)
    resumed = events(log, "trainer_resumed")
    assert resumed and resumed[-1]["step"] in (2, 4)
    assert sorted(set(steps_logged(log))) == list(range(6)), "every step trained"
    groups = [g for gs in delivered(b).values() for g in gs]
    assert len(groups) == len(set(groups)) == 12, "each group in exactly one step"


def test_two_ranks_whose_taskset_runs_out_publish_and_save_the_last_step_trained(broker_factory, clients,
                                                                                  tiny_model, tmp_path):
    """Two tasks and total_steps 5: step 0 is the run's last. Rank 0 tells the other rank to publish it (a version
    gathered from both ranks' shards, though `sync_interval` is 2) and save its shards (though `checkpoint_every`
    is 4), and both ranks end."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "1 + 1", "answer": "2"}\n{"prompt": "2 + 2", "answer": "4"}\n')
    finite = (*SETS, "sync.max_staleness=4", "data.taskset=file", f"data.path={tasks}")
    b = broker_factory(*finite)
    ex = clients(b, "explorer", "feeder")
    for lease in ex.request(P.LEASE, {"max_tasks": 2, "policy_version": 0}).header["tasks"]:
        ex.put(synthetic(lease["lease_id"]), timeout=10)
    log = tmp_path / "trainer.jsonl"
    train(b, tmp_path / "run", tiny_model, log, 2, 5, 4, *finite, "sync.sync_interval=2")
    assert [e["step"] for e in events(log, "taskset_exhausted")] == [1]
    assert steps_logged(log) == [0]
    assert [e["policy_version"] for e in events(log, "weights_published")] == [1]
    assert load_file(tmp_path / "run" / "weights" / "v1" / "model.safetensors").keys() == \
        load_file(os.path.join(tiny_model, "model.safetensors")).keys(), "the whole model, gathered"
    shards = tmp_path / "run" / "checkpoints" / "step_00000000"
    assert (shards / "meta.pt").exists() and len(list((shards / "shards").glob("*.distcp"))) == 2
    assert [e["world_size"] for e in events(log, "trainer_ranks_done")] == [2]
    # The same directory resumed with another model: its sharded checkpoint is refused by the shapes DCP recorded.
    # (On a broker that has pinned no model: the run's own refuses it first, asked before the model loads.)
    wider = str(make_tiny(tmp_path / "wider", tiny_model, hidden=192))
    done = subprocess.run([sys.executable, "-m", "rlbus.cli", "trainer", "--broker", broker_factory(*finite).address,
                           "--set", f"run.dir={tmp_path / 'run'}", "--set", f"model.path={wider}", "--set",
                           "rollout.dtype=float32"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.splitlines()[-1].startswith(
        f"error: cannot resume from {shards}: lm_head.weight is [49152, 128] in it and [49152, 192] in this model"), \
        done.stderr[-2000:]

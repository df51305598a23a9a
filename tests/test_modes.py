"""Each mode preset, run for real on the tiny model, orders rollouts, training and syncs as its diagram does.

Every check reads the structured logs of the run; in every mode the trainer
never trains on data staler than the bound. The synchronous and fully
asynchronous runs are long enough to show the tiny model learning too: the
reward (tests/helpers/first_token.py) pays for a first response token in the
lower half of the vocabulary, responses are one token long, so every trained
token carries the signal, and a fresh random model earns about 0.5. One run of
each serves both its mode's checks and the learning check.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlbus.common.config import load_config
from rlbus.logview import events as log_events
from rlbus.timeline import build
from tests.conftest import REPO, TINY_KV_MB, free_port

pytestmark = pytest.mark.slow  # starts engines or trains

STEPS = 8
LEARNING_STEPS = 30
WINDOW = 6  # batches averaged at either end of a learning run


def run_preset(preset: str, tiny_model: str, tmp_path: Path, *extra: str, timeout: float = 240) -> tuple[Path, dict]:
    run_dir = tmp_path / "run"
    sets = [f"run.dir={run_dir}", f"model.path={tiny_model}", f"broker.port={free_port()}",
            f"broker.pub_port={free_port()}", "broker.heartbeat_interval_s=0.5", "rollout.repeat=4",
            "data.batch_tasks=2", f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=0",
            "trainer.micro_batch=8", "trainer.fetch_wait_s=1", "rollout.max_tokens=8", "rollout.dtype=float32",
            f"explorer.kv_cache_mb={TINY_KV_MB}", "explorer.tasks_per_lease=2", "algorithm.skip_zero_spread=false",
            'launch.trainer_cpus=""', "launch.explorer_cpus=[]", "logging.format=json", *extra]
    preset_path = REPO / "configs" / "modes" / f"{preset}.yaml"
    args = [sys.executable, "-m", "rlbus.cli", "up", str(preset_path)] + [x for s in sets for x in ("--set", s)]
    up = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = up.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        up.terminate()  # the launcher stops its components
        _, err = up.communicate(timeout=120)
        raise AssertionError(f"{preset} did not finish within {timeout} s: {err[-3000:]}") from None
    assert up.returncode == 0, err[-3000:]
    cfg = load_config(preset_path, sets, environ={})
    return run_dir, {"cfg": cfg}


def events(run_dir: Path, name: str, event: str) -> list[dict]:
    return log_events(run_dir / "logs" / f"{name}.jsonl", event)


def explorer_names(run_dir: Path) -> list[str]:
    return sorted(p.stem for p in (run_dir / "logs").glob("explorer-*.jsonl"))


def check_staleness(run_dir: Path, bound: int, total: int = STEPS) -> None:
    steps = events(run_dir, "trainer", "train_step")
    assert len(steps) == total
    worst = max((int(k) for s in steps for k in s["staleness"]), default=0)
    assert worst <= bound, f"staleness {worst} > {bound}"


def overlaps(a, b) -> bool:
    return a.start < b.end and b.start < a.end


@pytest.fixture(scope="module")
def learning_runs(tiny_model, tmp_path_factory):
    """The synchronous and fully asynchronous presets, each run once with the learnable reward: preset ->
    (run directory, config)."""
    runs: dict[str, tuple[Path, dict] | BaseException] = {}

    def run(preset: str) -> tuple[Path, dict]:
        if preset not in runs:
            try:
                runs[preset] = run_preset(
                    preset, tiny_model, tmp_path_factory.mktemp(preset), "reward.fn=tests.helpers.first_token:score",
                    "rollout.max_tokens=1", "trainer.lr=1e-2", f"trainer.total_steps={LEARNING_STEPS}",
                    "rollout.repeat=8", "data.batch_tasks=4", "explorer.tasks_per_lease=4",
                    "algorithm.skip_zero_spread=true", "algorithm.informative_wait_s=2", timeout=600)
            except (Exception, pytest.fail.Exception) as exc:  # a failed run fails every check on it, once
                runs[preset] = exc
        if isinstance(runs[preset], BaseException):
            raise runs[preset]
        return runs[preset]

    return run


@pytest.mark.timeout(660)
@pytest.mark.parametrize("preset", ["synchronous", "fully_async"])
def test_tiny_model_reward_rises(learning_runs, preset):
    run_dir, _ = learning_runs(preset)
    batches = sorted(events(run_dir, "explorer-0", "explorer_batch"), key=lambda e: e["batch_index"])
    rewards = [e["reward_mean"] for e in batches]
    assert len(rewards) >= LEARNING_STEPS
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    assert last >= first + 0.25, f"mean reward {first:.2f} over the first {WINDOW} batches, {last:.2f} over the last"
    steps = events(run_dir, "trainer", "train_step")
    assert len(steps) == LEARNING_STEPS and sum(1 for s in steps if s["samples"]) >= LEARNING_STEPS // 2


@pytest.mark.timeout(660)
def test_synchronous_no_rollout_overlaps_a_training_step(learning_runs):
    run_dir, info = learning_runs("synchronous")
    spans, _, _ = build(run_dir)
    rollouts = [s for s in spans if s.kind == "rollout"]
    training = [s for s in spans if s.kind == "train"]
    assert rollouts and training
    assert not [(r, t) for r in rollouts for t in training if overlaps(r, t)]
    check_staleness(run_dir, info["cfg"].sync.max_staleness, LEARNING_STEPS)


def test_one_step_off_policy_rollout_e_plus_1_overlaps_training_step_e(tiny_model, tmp_path):
    run_dir, info = run_preset("one_step_off_policy", tiny_model, tmp_path)
    batches = {e["batch_index"]: e for e in events(run_dir, "explorer-0", "explorer_batch")}
    overlapped = 0
    for step in events(run_dir, "trainer", "train_step"):
        nxt = batches.get(step["step"] + 1)
        if nxt is None or not step["samples"]:
            continue
        train = (step["ts"] - step["step_s"] + step["wait_s"], step["ts"] - step["publish_s"])
        roll = (nxt["ts"] - nxt["rollout_s"], nxt["ts"])
        overlapped += roll[0] < train[1] and train[0] < roll[1]
    assert overlapped >= (STEPS - 2) // 2, f"rollout e+1 overlapped training step e only {overlapped} times"
    for e in batches.values():  # batch e was generated with version >= e - 1
        assert e["policy_version"] >= max(0, e["batch_index"] - 1)
    check_staleness(run_dir, info["cfg"].sync.max_staleness)


@pytest.mark.timeout(660)
def test_fully_async_explorers_never_wait_for_weights(learning_runs):
    """No wait by batch index as in lockstep. The one bound of every style still holds: an explorer more than
    max_staleness versions behind the trainer's step loads newer weights first (it happens when the trainer trains
    faster than it publishes, as on a loaded machine), so only such waits may appear."""
    run_dir, info = learning_runs("fully_async")
    bound = info["cfg"].sync.max_staleness
    told = [e for e in events(run_dir, "broker", "lease_wait") if e["reason"] == "version"]
    assert all(e["policy_version"] < e["trainer_step"] - bound == e["need_version"] for e in told), told
    for name in explorer_names(run_dir):
        waits = events(run_dir, name, "waiting_for_weights")
        assert len(waits) <= sum(e["peer"] == name for e in told), waits
    check_staleness(run_dir, bound, LEARNING_STEPS)


# The multi-explorer asynchronous preset's ordering is tested on the run tests/test_run_record.py makes of it
# (test_multi_explorer_async_both_explorers_feed_the_buffer): one run of the preset serves both.


@pytest.mark.parametrize("preset,interval,offset", [("interval4_offset0", 4, 0), ("interval1_offset4", 1, 4)])
def test_interval_and_offset_sync_where_the_diagram_does(tiny_model, tmp_path, preset, interval, offset):
    run_dir, info = run_preset(preset, tiny_model, tmp_path)
    sync = info["cfg"].sync
    published = [e["policy_version"] for e in events(run_dir, "broker", "weights_published")]
    assert published == [v for v in range(1, STEPS + 1) if v % interval == 0]
    for e in events(run_dir, "explorer-0", "explorer_batch"):
        assert e["policy_version"] >= sync.required_version(e["batch_index"])
        if interval == 4:  # the next version only exists after the batch that needs it was trained
            assert e["policy_version"] == sync.required_version(e["batch_index"])
    waits = [e["need_version"] for e in events(run_dir, "explorer-0", "waiting_for_weights")]
    assert all(v % interval == 0 and v > 0 for v in waits)
    check_staleness(run_dir, offset + interval - 1)


def test_multi_explorer_async_by_broadcast(tiny_model, tmp_path):
    """The whole loop with sync_method nccl (gloo here): each version reaches every member of its epoch by
    broadcast; explorers join the group as they come (each explorer's vLLM engine starts at its own pace)."""
    run_dir, info = run_preset("multi_explorer_async", tiny_model, tmp_path, "sync.sync_method=nccl",
                               "sync.broadcast_backend=gloo", "sync.sync_timeout_s=60")
    epochs = events(run_dir, "trainer", "broadcast_epoch")
    members = {e["epoch"]: e["members"] for e in epochs}
    done = events(run_dir, "trainer", "broadcast_done")
    assert len(done) == STEPS and not events(run_dir, "trainer", "broadcast_aborted")
    loads = {name: {(e["policy_version"], e.get("method")) for e in events(run_dir, name, "weights_loaded")}
             for name in explorer_names(run_dir)}
    for e in done:
        for name in members[e["epoch"]]:
            assert (e["policy_version"], "nccl") in loads[name], (name, e["policy_version"])
    # Each explorer is in the first epoch opened after it joined the broker. (Its engine starts at its own
    # pace: on a loaded machine one can join after the last version was broadcast, and then it has no epoch.)
    joined = {e["peer"]: e["ts"] for e in events(run_dir, "broker", "peer_joined") if e["role"] == "explorer"}
    assert set(joined) == set(loads)
    for name, ts in joined.items():
        later = [e for e in epochs if e["ts"] > ts + 1.0]
        assert not later or name in later[0]["members"], (name, ts, epochs)
    assert any(len(m) >= 1 for m in members.values())
    for name in loads:
        assert not events(run_dir, name, "broadcast_failed")
    check_staleness(run_dir, info["cfg"].sync.max_staleness)


def test_streaming_explorers_swap_in_flight_one_at_a_time(tiny_model, tmp_path):
    """The preset's two streaming explorers, max_swapping 1: versions are swapped in with requests in flight,
    trajectories that spanned a swap are trained, and the two are never paused for a load at once."""
    # Versions must arrive while requests are in flight, and groups made across them must be among those trained.
    # Both hold where the explorers are the slower side: the trainer then waits for its batches, and every version
    # finds them generating. Where they are faster they stop at the staleness bound with nothing in flight, load
    # each version idle, and the trainer (which takes the oldest groups first) trains what they made before the
    # bound. Which side is faster must not depend on where other processes run: with the trainer pinned alone on one
    # core and the explorers on the other, another test's processes went to the trainer's (the less loaded) core,
    # its steps took 4.5 s instead of 1 s, and no trained group had spanned a swap. So all three share one core: a
    # core's time is shared evenly among the processes on it, whatever else runs there, and the explorers' work per
    # step (two groups of two 128-token samples, a decode step per token) outweighs the trainer's (a forward and
    # backward pass over them): so placed, in ten runs, 14-16 of the 16 loads swapped a version in with requests in
    # flight, steps 2-7 each trained 2-4 groups that spanned a swap, and the trainer waited 0.7-1.2 s a step for its
    # batch (median of a run); beside three busy loops on that core, 16 of 16 and 1.3 s.
    # A bound of 3 admits 8 groups at version 0, so the last 4 steps train groups begun after version 1 however slow
    # the first step. Two samples a group halve the trainer's work without the explorers' (a decode step of two
    # sequences costs about what one of four does here).
    core = min(os.sched_getaffinity(0))
    run_dir, info = run_preset("streaming", tiny_model, tmp_path, "rollout.max_tokens=128", "rollout.repeat=2",
                               "explorer.swap_lag=1", "explorer.inflight_tasks=1", "sync.max_staleness=3",
                               f'launch.trainer_cpus="{core}"', f'launch.explorer_cpus=["{core}","{core}"]')
    assert info["cfg"].launch.explorers == 2 and info["cfg"].sync.max_swapping == 1
    names = explorer_names(run_dir)
    assert len(names) == 2 and all(events(run_dir, n, "explorer_groups") for n in names)
    loads = [(e["ts"] - e["seconds"], e["ts"], name, e["in_flight"]) for name in names
             for e in events(run_dir, name, "weights_loaded")]
    assert any(in_flight for *_, in_flight in loads), "no version was swapped in with requests in flight"
    loads.sort()
    for (_, end, a, _), (start, _, b, _) in zip(loads, loads[1:]):
        assert end <= start, f"{a} and {b} were paused for a load at the same time"
    steps = events(run_dir, "trainer", "train_step")
    assert sum(s["swapped"] for s in steps) > 0
    for s in steps:
        if s["version_span"]:
            assert s["step"] - s["version_span"][0] <= info["cfg"].sync.max_staleness
    for name in names:
        assert not events(run_dir, name, "waiting_for_weights")
    spans, _, _ = build(run_dir)
    assert {s.lane for s in spans if s.kind == "rollout"} == set(names)  # the timeline draws streaming rollouts
    check_staleness(run_dir, info["cfg"].sync.max_staleness)

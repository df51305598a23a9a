"""`rlbus up`: the whole loop on one machine, on the tiny model, to the end and cleanly stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, free_port


def test_up_runs_broker_trainer_and_explorer_to_the_end(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    sets = [f"run.dir={run_dir}", f"model.path={tiny_model}", f"broker.port={free_port()}",
            f"broker.pub_port={free_port()}", "broker.heartbeat_interval_s=0.5", "data.repeat=4",
            "data.batch_tasks=2", "sync.sync_style=lockstep", "sync.sync_interval=1", "sync.sync_offset=1",
            "trainer.total_steps=3", "trainer.checkpoint_every=2", "trainer.micro_batch=4", "trainer.lr=1e-4",
            "trainer.fetch_wait_s=1", "explorer.max_tokens=8", "explorer.dtype=float32",
            "explorer.memory_fraction=0.1", "launch.explorers=1", "launch.status_interval_s=1",
            "logging.format=json", "algorithm.skip_zero_spread=false", "explorer.eval_every=2",
            "data.eval_size=6"]
    args = [sys.executable, "-m", "common.cli", "up"] + [x for s in sets for x in ("--set", s)]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert done.returncode == 0, done.stderr[-3000:]
    names = [e["event"] for e in events]
    assert "trainer_finished" in names and names[-2:] == ["run_stopped", "run_summary"]
    pids = [e["pid"] for e in events if e["event"] == "component_started"]
    assert len(pids) == 3
    for pid in pids:  # every component, and its process group, is gone
        try:
            os.killpg(pid, 0)
            raise AssertionError(f"process group {pid} still exists")
        except ProcessLookupError:
            pass
    assert (run_dir / "config.yaml").exists()
    for name in ("broker", "trainer", "explorer-0"):
        assert (run_dir / "logs" / f"{name}.jsonl").stat().st_size > 0
    steps = [json.loads(line) for line in (run_dir / "logs" / "trainer.jsonl").read_text().splitlines()
             if '"train_step"' in line]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(max(map(int, s["staleness"])) <= 1 for s in steps if s["staleness"]), "O + I - 1 = 1"
    assert (run_dir / "weights" / "v3" / "model.safetensors").exists()
    assert (run_dir / "checkpoints").exists()
    assert any(e["event"] == "run_progress" for e in events)
    # The timeline draws exactly what the logs say.
    from common.timeline import render

    spans = render(run_dir, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    batches = [json.loads(x) for x in (run_dir / "logs" / "explorer-0.jsonl").read_text().splitlines()
               if '"explorer_batch"' in x]
    assert len([s for s in spans if s.kind == "rollout"]) == len(batches)
    assert len([s for s in spans if s.lane == "trainer" and s.kind == "train"]) == len(steps)
    origin = min(s.start for s in spans)
    first = min((s for s in spans if s.kind == "rollout"), key=lambda s: s.end)
    assert first.end - first.start == pytest.approx(batches[0]["rollout_s"], abs=1e-6) and origin <= first.start
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["accuracy_before"] is not None
    assert [v for _, v, _ in summary["accuracy_by_time"]][0] == 0
    assert summary["final_version"] == 3, "the last weights are evaluated on the way out"
    assert summary["reward_last_steps"] is not None


def test_components_stop_when_the_launcher_is_killed(tiny_model, tmp_path):
    """SIGKILL of `rlbus up` itself (it cannot clean up) still leaves no component running."""
    import signal
    import time

    sets = [f"run.dir={tmp_path / 'run'}", f"model.path={tiny_model}", f"broker.port={free_port()}",
            f"broker.pub_port={free_port()}", "launch.explorers=0", "logging.format=json"]
    args = [sys.executable, "-m", "common.cli", "up"] + [x for s in sets for x in ("--set", s)]
    up = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        for line in up.stderr:
            if '"component_started"' in line:
                pids.append(json.loads(line)["pid"])
            if len(pids) == 2:
                break
        assert len(pids) == 2, "broker and trainer did not start"
        up.kill()
        up.wait(10)
        deadline = time.monotonic() + 60
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in pids if _exists(p)]
            time.sleep(0.2)
        assert not alive, f"components {alive} outlived the launcher"
    finally:
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes: its parent (the dead launcher) was reaped, init reaps it.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("together, told, expected", [(True, 0, 3), (True, 1, 1), (False, 0, 0)])
def test_the_effective_config_has_the_trainer_wait_for_every_explorer(tmp_path, together, told, expected):
    from common.config import load_config
    from common.launcher import Launcher

    cfg = load_config(None, [f"run.dir={tmp_path}/run", "broker.port=5555", "broker.pub_port=5556",
                             "launch.explorers=3", f"launch.start_together={together}",
                             f"trainer.wait_for_explorers={told}"], environ={})
    launcher = Launcher(cfg)
    snapshot = load_config(launcher.snapshot, [], environ={})
    assert snapshot.trainer.wait_for_explorers == expected

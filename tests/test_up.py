"""`rlbus up`: the whole loop on one machine, on the tiny model, to the end and cleanly stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from rlbus.logview import events as log_events, events_in_text
from tests.conftest import REPO, TINY_KV_MB, free_port


class Exits:
    """A stand-in for a child's Popen (unit test only): poll() gives the codes in turn, then the last for good."""

    def __init__(self, *codes):
        self.codes = list(codes)

    def poll(self):
        return self.codes.pop(0) if len(self.codes) > 1 else self.codes[0]


def test_a_trainer_that_finishes_while_the_launcher_looks_ends_the_run_as_finished(tmp_path):
    """The launcher polls every child once per look: a trainer that exits 0 between two polls of it was taken
    for running and then for failed (`component_failed`, exit code 0), and a finished run ended with status 1."""
    from rlbus.common.config import load_config
    from rlbus.launcher import Launcher

    cfg = load_config(None, [f"run.dir={tmp_path}/run", "broker.port=5555", "broker.pub_port=5556",
                             "launch.explorers=1"], environ={})
    launcher = Launcher(cfg)
    broker, trainer, explorer = launcher.children
    broker.proc, trainer.proc, explorer.proc = Exits(None), Exits(None, 0), Exits(None)
    assert launcher._check_children() is False
    assert launcher._check_children() is True and launcher.exit_code == 0
    broker.proc, trainer.proc = Exits(None), Exits(None, 1)
    assert launcher._check_children() is False
    assert launcher._check_children() is True and launcher.exit_code == 1



def test_the_summary_counts_a_step_trained_again_after_a_resume_once_with_its_last_reward(tmp_path):
    from rlbus.common.config import load_config
    from rlbus.launcher import Launcher

    cfg = load_config(None, [f"run.dir={tmp_path}/run", "broker.port=5555", "broker.pub_port=5556"], environ={})
    launcher = Launcher(cfg)
    lines = [{"event": "train_step", "level": "info", "ts": float(i), "step": step, "reward_mean": reward}
             for i, (step, reward) in enumerate([(0, 0.1), (1, 0.2), (2, 0.3), (1, 0.25), (2, 0.35), (3, 0.4)])]
    (launcher.logs / "trainer.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    summary = launcher.summary()
    assert summary["steps"] == 4
    assert summary["reward_by_step"] == [(0, 0.1), (1, 0.25), (2, 0.35), (3, 0.4)]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4


def test_eval_overlap_on_cores_the_trainer_shares_is_warned_about():
    """Evaluation beside training on the trainer's own cores slows both many times over: `rlbus up` says so."""
    from structlog.testing import capture_logs

    from rlbus.common.config import load_config
    from rlbus.launcher import check_eval_overlap

    have = sorted(os.sched_getaffinity(0))

    def warned(*sets):
        cfg = load_config(None, ["explorer.eval_overlap=true", "explorer.eval_every=3", "launch.explorers=1", *sets],
                          environ={})
        with capture_logs() as logs:
            check_eval_overlap(cfg)
        return [e for e in logs if e["event"] == "eval_overlap_on_shared_cores"]

    assert warned(), "unpinned, both run on every core"
    shared = warned(f'launch.trainer_cpus="{have[0]}"', f'launch.explorer_cpus=["{have[0]}"]')
    assert shared and shared[0]["cpus"] == [have[0]]
    assert not warned("explorer.eval_overlap=false")
    assert not warned("explorer.eval_every=0")
    assert not warned("trainer.device=cuda")
    if len(have) > 1:
        assert not warned(f'launch.trainer_cpus="{have[0]}"', f'launch.explorer_cpus=["{have[1]}"]')

def test_up_starts_a_reward_worker_for_explorers_that_score_through_one_and_stops_it_after_them(tiny_model, tmp_path):
    """With `reward.service` the explorers score through reward workers; `rlbus up` started none, so they waited
    for one for ever. Now it starts one offering that service, and stops it after the explorers that may ask it."""
    run_dir = tmp_path / "run"
    sets = [f"run.dir={run_dir}", f"model.path={tiny_model}", "broker.port=0", "broker.pub_port=0",
            "broker.heartbeat_interval_s=0.5", "rollout.repeat=4", "data.batch_tasks=2", "trainer.total_steps=2",
            "trainer.micro_batch=4", "trainer.fetch_wait_s=1", "rollout.max_tokens=8", "rollout.dtype=float32",
            f"explorer.kv_cache_mb={TINY_KV_MB}", "launch.explorers=1", "logging.format=json",
            "algorithm.skip_zero_spread=false", "explorer.eval_every=0", "reward.service=arith"]
    args = [sys.executable, "-m", "rlbus.cli", "up"] + [x for s in sets for x in ("--set", s)]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    events = events_in_text(done.stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    started = {e["component"]: e["pid"] for e in events if e["event"] == "component_started"}
    assert sorted(started) == ["broker", "explorer-0", "reward", "trainer"]
    for pid in started.values():
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    logs = run_dir / "logs"
    assert [e["services"] for e in log_events(logs / "reward.jsonl", "reward_worker_ready")] == [["arith"]]
    served = log_events(logs / "reward.jsonl", "reward_worker_stopped")
    assert len(served) == 1 and served[0]["served"] >= 8, "it scored the explorer's groups"
    routed = {e["worker"] for e in log_events(logs / "broker.jsonl", "eval_routed")}
    assert routed == {"reward"}
    assert [s["step"] for s in log_events(logs / "trainer.jsonl", "train_step")] == [0, 1]
    assert len(log_events(logs / "broker.jsonl", "run_finished")) == 1, "the trainer's last step ended the run"
    assert not log_events(logs / "explorer-0.jsonl", "stopped_with_groups_unscored"), "the worker outlived it"
    for out in logs.glob("*.out"):  # what each component wrote to stdout and stderr: no teardown noise
        assert "nanobind" not in out.read_text(errors="replace"), out.name


@pytest.mark.slow
def test_up_runs_broker_a_two_rank_trainer_and_explorer_to_the_end(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    # Ports 0: the broker binds free ones, and the launcher passes them on.
    sets = [f"run.dir={run_dir}", f"model.path={tiny_model}", "broker.port=0",
            "broker.pub_port=0", "broker.heartbeat_interval_s=0.5", "rollout.repeat=4",
            "data.batch_tasks=2", "sync.sync_style=lockstep", "sync.sync_interval=1", "sync.sync_offset=1",
            "trainer.total_steps=3", "trainer.checkpoint_every=2", "trainer.micro_batch=4", "trainer.lr=1e-4",
            "trainer.fetch_wait_s=1", "rollout.max_tokens=8", "rollout.dtype=float32",
            f"explorer.kv_cache_mb={TINY_KV_MB}", "launch.explorers=1", "launch.status_interval_s=1",
            "logging.format=json", "algorithm.skip_zero_spread=false", "explorer.eval_every=2",
            "data.eval_size=6", "trainer.world_size=2"]
    args = [sys.executable, "-m", "rlbus.cli", "up"] + [x for s in sets for x in ("--set", s)]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    events = events_in_text(done.stderr)
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
    snapshot = yaml.safe_load((run_dir / "config.yaml").read_text())["broker"]
    bound = json.loads((run_dir / "buffer" / "endpoints.json").read_text())
    assert bound["router"] == f"tcp://127.0.0.1:{snapshot['port']}" == snapshot["address"] and snapshot["port"]
    assert bound["pub"] == f"tcp://127.0.0.1:{snapshot['pub_port']}" == snapshot["pub_address"]
    for name in ("broker", "trainer", "explorer-0"):
        assert (run_dir / "logs" / f"{name}.jsonl").stat().st_size > 0
    steps = log_events(run_dir / "logs" / "trainer.jsonl", "train_step")
    assert [s["step"] for s in steps] == [0, 1, 2]
    ranks = log_events(run_dir / "logs" / "trainer.jsonl", "trainer_ranks_started")  # FSDP2 on two ranks
    assert len(ranks) == 1 and len(ranks[0]["pids"]) == 2
    assert all(not os.path.exists(f"/proc/{pid}") for pid in ranks[0]["pids"])
    assert (run_dir / "checkpoints" / "step_00000001" / "meta.pt").exists(), "a sharded checkpoint"
    assert all(max(map(int, s["staleness"])) <= 1 for s in steps if s["staleness"]), "O + I - 1 = 1"
    assert (run_dir / "weights" / "v3" / "model.safetensors").exists()
    assert (run_dir / "checkpoints").exists()
    assert any(e["event"] == "run_progress" for e in events)
    # The timeline draws exactly what the logs say.
    from rlbus.timeline import render

    spans = render(run_dir, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    batches = log_events(run_dir / "logs" / "explorer-0.jsonl", "explorer_batch")
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


@pytest.mark.slow
def test_components_stop_when_the_launcher_is_killed(tiny_model, tmp_path):
    """SIGKILL of `rlbus up` itself (it cannot clean up) still leaves no component running."""
    import signal

    sets = [f"run.dir={tmp_path / 'run'}", f"model.path={tiny_model}", f"broker.port={free_port()}",
            f"broker.pub_port={free_port()}", "launch.explorers=0", "logging.format=json"]
    args = [sys.executable, "-m", "rlbus.cli", "up"] + [x for s in sets for x in ("--set", s)]
    up = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        for line in up.stderr:
            pids += [e["pid"] for e in events_in_text(line, "component_started")]
            if len(pids) == 2:
                break
        assert len(pids) == 2, "broker and trainer did not start"
        up.kill()
        up.wait(10)
        alive = _still(pids, _exists, 60)
        assert not alive, f"components {alive} outlived the launcher"
    finally:
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _still(pids: list[int], exists, timeout: float) -> list[int]:
    """The pids for which `exists` still holds after up to `timeout` seconds of waiting for none to."""
    import time

    deadline = time.monotonic() + timeout
    left = [p for p in pids if exists(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if exists(p)]
    return left


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
    from rlbus.common.config import load_config
    from rlbus.launcher import Launcher

    cfg = load_config(None, [f"run.dir={tmp_path}/run", "broker.port=5555", "broker.pub_port=5556",
                             "launch.explorers=3", f"launch.start_together={together}",
                             f"trainer.wait_for_explorers={told}"], environ={})
    launcher = Launcher(cfg)
    snapshot = load_config(launcher.snapshot, [], environ={})
    assert snapshot.trainer.wait_for_explorers == expected


@pytest.mark.slow
def test_closing_the_terminal_stops_the_run_and_leaves_no_process(tiny_model, tmp_path):
    """`rlbus up` in a terminal that closes mid-run: the kernel sends SIGHUP to it, and every later write
    to the terminal fails (EIO). It stops the run as on SIGTERM, writes its summary, and nothing is left."""
    import fcntl
    import pty
    import termios
    import threading
    import time

    run_dir = tmp_path / "run"
    sets = [f"run.dir={run_dir}", f"model.path={tiny_model}", f"broker.port={free_port()}",
            f"broker.pub_port={free_port()}", "broker.heartbeat_interval_s=0.2", "rollout.repeat=4",
            "data.batch_tasks=2", "trainer.total_steps=100000", "trainer.micro_batch=4", "trainer.fetch_wait_s=1",
            "rollout.max_tokens=8", "rollout.dtype=float32", f"explorer.kv_cache_mb={TINY_KV_MB}",
            "launch.explorers=1", "launch.status_interval_s=1", "logging.format=json", "explorer.eval_every=0",
            "algorithm.skip_zero_spread=false"]
    args = [sys.executable, "-m", "rlbus.cli", "up"] + [x for s in sets for x in ("--set", s)]
    master, terminal = pty.openpty()

    def own_terminal() -> None:  # a session of its own, with the pty as its controlling terminal
        os.setsid()
        fcntl.ioctl(terminal, termios.TIOCSCTTY, 0)

    up = subprocess.Popen(args, cwd=REPO, stdin=terminal, stdout=terminal, stderr=terminal, preexec_fn=own_terminal)
    os.close(terminal)
    shown: list[bytes] = []

    def read() -> None:  # keep the terminal drained until it is closed
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            shown.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    pids: list[int] = []
    try:
        trainer_log = run_dir / "logs" / "trainer.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and up.poll() is None:
            if trainer_log.exists() and '"train_step"' in trainer_log.read_text():
                break
            time.sleep(0.2)
        text = b"".join(shown).decode(errors="replace")
        pids = [e["pid"] for e in events_in_text(text, "component_started")]
        assert len(pids) == 3 and up.poll() is None, text[-3000:]
        os.close(master)  # the terminal closes
        master = -1
        assert up.wait(120) == 0
        left = _still(pids, _group_exists, 30)
        assert not left, f"process groups {left} outlived the run"
        last = log_events(run_dir / "logs" / "trainer.jsonl")[-1]
        assert last["event"] == "trainer_stopped", "the trainer stopped cleanly"
        assert (run_dir / "summary.json").exists(), "the launcher finished its stop though it could not write"
    finally:
        if master >= 0:
            os.close(master)
        for pid in [up.pid, *pids]:
            try:
                os.killpg(pid, 9)
            except ProcessLookupError:
                pass
        up.wait(10)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_broker_that_cannot_come_up_ends_the_run_with_its_reason_and_no_traceback(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "rlbus.cli", "up", "--set", f"run.dir={tmp_path / 'run'}",
                               "--set", f"broker.port={port}", "--set", "launch.explorers=0",
                               "--set", "logging.format=json"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 1, proc.stderr[-2000:]
    failed = [e for e in events_in_text(proc.stderr + proc.stdout, "run_failed")]
    assert len(failed) == 1 and "Address already in use" in failed[0]["error"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_a_component_that_fails_is_reported_with_the_reason_its_log_gives(tmp_path):
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    proc = subprocess.run([sys.executable, "-m", "rlbus.cli", "up", "--set", f"run.dir={tmp_path / 'run'}",
                           "--set", f"model.path={not_a_model}", "--set", "launch.explorers=0",
                           "--set", "logging.format=json"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 1, proc.stderr[-2000:]
    failed = events_in_text(proc.stderr + proc.stdout, "component_failed")
    assert [(e["component"], e["exit_code"]) for e in failed] == [("trainer", 2)], proc.stderr[-2000:]
    assert "is a directory without config.json" in failed[0]["error"]


def test_the_reason_of_a_component_that_fails_is_what_its_log_says_else_the_error_line_it_printed(tmp_path):
    """An explorer given a model that is none logs `explorer_failed` with the reason; one whose config does not load
    exits before its JSON log starts, with a one-line `error: ...` on stderr (which `rlbus up` keeps as
    logs/NAME.out): that line is the reason `component_failed` gives."""
    from rlbus.launcher import last_error

    logs = tmp_path / "logs"
    logs.mkdir()

    def explorer(setting: str) -> int:
        with open(logs / "explorer-0.out", "w") as out:
            return subprocess.run([sys.executable, "-m", "rlbus.cli", "explorer", "--set", setting,
                                   "--set", f"run.dir={tmp_path}", "--set", "logging.format=json",
                                   "--set", f"logging.file={logs / 'explorer-0.jsonl'}"],
                                  stdout=subprocess.DEVNULL, stderr=out, timeout=120, cwd=REPO).returncode

    assert explorer("model.path=/nonexistent") == 2
    failed = log_events(logs / "explorer-0.jsonl", "explorer_failed")
    assert [e["error"] for e in failed] == ["model.path='/nonexistent' is neither a bundled model (['smollm2-135m']), "
                                            "a local HF model directory, nor a hub id (owner/name)"]
    assert last_error(logs, "explorer-0") == failed[0]["error"]
    (logs / "explorer-0.jsonl").unlink()
    assert explorer("explorer.temperature=1") == 2
    assert not (logs / "explorer-0.jsonl").exists()
    assert last_error(logs, "explorer-0") == ("explorer.temperature is now rollout.temperature: the settings every "
                                              "process of a run must agree on live in the rollout section")
    assert last_error(logs, "trainer") is None  # no log at all
    (logs / "explorer-0.jsonl").write_text('{"event": "explorer_failed", "level": "error", "ts": 1, '
                                           '"error": "from its log"}\n')
    assert last_error(logs, "explorer-0") == "from its log"  # what the component logged comes first


def test_a_second_rlbus_up_on_a_run_directory_in_use_is_refused_before_it_writes_there(tmp_path):
    """It wrote its own config.yaml over the running one's (which a restarted broker and `rlbus replay` read)."""
    from rlbus.common.processes import hold_lock

    lock = hold_lock(tmp_path / "run.lock")  # as the first `rlbus up` holds it
    (tmp_path / "config.yaml").write_text("the first run's\n")
    try:
        done = subprocess.run([sys.executable, "-m", "rlbus.cli", "up", "--set", f"run.dir={tmp_path}"], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
    finally:
        lock.close()
    assert done.returncode == 2 and done.stderr == (f"error: run.dir: {tmp_path} is the directory of a run in progress "
                                                    f"(rlbus up, pid {os.getpid()}); give another run.dir, or stop "
                                                    "that run\n"), done.stderr
    assert (tmp_path / "config.yaml").read_text() == "the first run's\n" and not (tmp_path / "summary.json").exists()

"""Every benchmark runs in its smoke mode, exits by itself and ends with its JSON figures (the central ones
not null).

A benchmark that crashes at start or hangs at exit would otherwise only be
found when someone needs its figure. Each runs as a subprocess in its own
process group, which the test kills if it overruns. They run two at a time
(each test, while it waits for its own, starts the next as one ends).
A count a benchmark cannot run with (no producers, PUTs of part groups, a
negative number of steps) is a usage error at once, not a hang or a crash
midway.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

BENCHMARKS = {
    "broker_throughput": [],
    "reward": [],
    "trainer": ["--model", "{tiny}", "--world-size", "2", "--serve", "1"],
    "explorer": ["--model", "{tiny}"],
    "weight_sync": ["--model", "{tiny}"],
    "weight_sync_link": ["--model", "{tiny}", "--link-mbit", "2000"],
    "modes": ["--model", "{tiny}"],
    "streaming": ["--model", "{tiny}"],
    "learning": ["--model", "{tiny}"],
    "cores": ["--model", "{tiny}"],
    "trainer_ab": ["--model", "{tiny}", "--b", "trainer.fused_optimizer=true"],
}
SCRIPTS = {"weight_sync_link": "weight_sync"}  # a second smoke of one script (the rest: the script of that name)
# Figures a smoke run must give (not null), so that a central figure cannot go missing unseen.
FIGURES = {"weight_sync": ("network_ratio", "delta_bytes_share"),
           "weight_sync_link": ("network_ratio", "delta_bytes_share"), "trainer": ("tokens_per_s", "serving"),
           "cores": ("rival_ratio", "rival_ratio_fewer", "fewer_ratio"),
           "trainer_ab": ("a_median_s", "b_median_s", "paired_median_diff_s"),
           "broker_throughput": ("ratio_to_per_message", "small_disk_bound_ratio_to_per_message",
                                 "large_ingest_ratio_to_disk", "large_store_alone_ratio_to_disk",
                                 "large_ingest_cpu_bound_ratio_to_disk",
                                 "large_window")}
# Figures measured in rounds (a smoke makes 2): {figure: (the rounds' key, the field each round holds it in)}.
ROUNDS = {"broker_throughput": {"ratio_to_per_message": ("ratio_to_per_message_rounds", None),
                                "large_ingest_ratio_to_disk": ("large_ingest_rounds", "ratio_to_disk")}}
# Lines a smoke run must print: the broker's CPU split by thread, its writer and ZeroMQ's I/O named.
PRINTS = {"broker_throughput": ("the broker's by thread: loop", "rlbus-writer", "zmq_io")}
# The explorers' host is a network namespace: root and iproute2's ip and tc.
LINK_UNAVAILABLE = "" if os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc") else \
    "the link needs root, ip and tc"

SMOKE_TIMEOUT_S = 400
KILL_GRACE_S = 15  # from SIGTERM to SIGKILL
AT_ONCE = 2  # smoke runs side by side: much of each is one-core work (imports, engine start-up)


class Smoke:
    """One benchmark's smoke run, in its own process group (killed whole if it overruns or the test ends).

    Its output goes to files, not pipes, so that nothing but the test's own
    thread is needed to run it: every process is started from that thread.
    """

    def __init__(self, name: str, tiny: str, out_dir: Path):
        self.name = name
        self.args = [sys.executable, f"benchmarks/{SCRIPTS.get(name, name)}.py", "--smoke",
                     *(a.format(tiny=tiny) for a in BENCHMARKS[name])]
        self.out = out_dir / f"{name}.out"
        self.err = out_dir / f"{name}.err"
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def start(self) -> None:
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(self.args, cwd=REPO, stdout=out, stderr=err, start_new_session=True)
        self.started = time.monotonic()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def done(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def result(self) -> tuple[int, str, str]:
        return self.proc.returncode, self.out.read_text(), self.err.read_text()

    def kill(self) -> None:
        """SIGTERM first, so that a run takes down what it set up (a network link); SIGKILL after a grace."""
        if self.running:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


class Smokes:
    """The smoke runs of `names`, AT_ONCE at a time, moved on by whichever test is waiting."""

    def __init__(self, tiny: str, out_dir: Path, names: set[str]):
        self.runs = {name: Smoke(name, tiny, out_dir) for name in sorted(names)
                     if not (name == "weight_sync_link" and LINK_UNAVAILABLE)}
        self.queue = list(self.runs.values())

    def pump(self) -> None:
        for run in self.runs.values():
            if run.running and time.monotonic() - run.started > SMOKE_TIMEOUT_S:
                run.kill()
        while self.queue and sum(r.running for r in self.runs.values()) < AT_ONCE:
            self.queue.pop(0).start()

    def wait(self, name: str) -> tuple[int, str, str]:
        run = self.runs[name]
        while not run.done:
            self.pump()
            time.sleep(0.1)
        self.pump()  # the next run starts before this test's assertions
        return run.result()

    def kill(self) -> None:
        for run in self.runs.values():
            run.kill()


def selected(session: pytest.Session) -> set[str]:
    """The benchmarks whose smoke test this session runs (`-k` may leave some out: those are not started)."""
    return {item.callspec.params["name"] for item in session.items
            if getattr(item, "originalname", "") == test_benchmark_smoke_mode_runs_and_exits.__name__}


@pytest.fixture(scope="module")
def smokes(request, tiny_model, tmp_path_factory):
    runs = Smokes(tiny_model, tmp_path_factory.mktemp("smokes"), selected(request.session))
    yield runs
    runs.kill()


@pytest.mark.slow
@pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_smoke_mode_runs_and_exits(name, smokes):
    if name not in smokes.runs:
        pytest.skip(LINK_UNAVAILABLE)
    code, out, err = smokes.wait(name)
    assert code != -signal.SIGKILL, f"{name} did not exit within {SMOKE_TIMEOUT_S} s: {err[-3000:]}"
    assert code == 0, err[-3000:]
    figures = json.loads(out.strip().splitlines()[-1])
    assert isinstance(figures, dict) and figures
    missing = [key for key in FIGURES.get(name, ()) if figures.get(key) is None]
    assert not missing, f"{name} gave no {missing}: {out[-2000:]}"
    for figure, (key, field) in ROUNDS.get(name, {}).items():  # one entry a round; the figure, their lower median
        rounds = [r[field] if field else r for r in figures[key]]
        assert len(rounds) == 2 and figures[figure] == pytest.approx(statistics.median_low(rounds), abs=2e-3), \
            f"{name}: {figure} {figures[figure]}, rounds {figures[key]}"
    unsaid = [words for words in PRINTS.get(name, ()) if words not in out]
    assert not unsaid, f"{name} did not print {unsaid}: {out[-2000:]}"


HOLD_A_LINK = ("import sys, time; sys.path.insert(0, '.'); from benchmarks.links import link\n"
               "with link(2000) as tag:\n    print(tag, flush=True); time.sleep(120)")


def namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


def hold_a_link() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD_A_LINK], cwd=REPO, stdout=subprocess.PIPE, text=True)
    tag = proc.stdout.readline().strip()
    assert tag.startswith("rlws") and tag in namespaces(), tag
    return proc, tag


@pytest.mark.skipif(bool(LINK_UNAVAILABLE), reason=LINK_UNAVAILABLE or "-")
def test_a_link_left_by_a_killed_benchmark_does_not_cut_off_the_next_one():
    # SIGKILL runs no cleanup: the namespace stays, with the address every link uses. The next link drops it.
    proc, stale = hold_a_link()
    proc.kill()
    proc.wait()
    assert stale in namespaces()
    from benchmarks.links import link

    with link(2000) as tag:
        assert stale not in namespaces() and tag in namespaces()
        listed = subprocess.run(["ip", "-n", tag, "-br", "-4", "addr"], capture_output=True, text=True).stdout
        assert "10.232.0.2/30" in listed
    assert tag not in namespaces()


@pytest.mark.skipif(bool(LINK_UNAVAILABLE), reason=LINK_UNAVAILABLE or "-")
def test_a_benchmark_stopped_by_sigterm_takes_its_link_down_and_a_live_ones_link_is_not_taken():
    proc, tag = hold_a_link()
    try:
        from benchmarks.links import link

        with pytest.raises(SystemExit, match="10.232.0.1 is held by interface"):
            with link(2000):
                pass
        assert tag in namespaces(), "the live benchmark's link is left alone"
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    assert code == 128 + signal.SIGTERM
    assert tag not in namespaces()


# Sends this process SIGTERM as the link is being made, after its namespace exists (as a test's teardown may stop
# a smoke that has only just started).
TERM_WHILE_LINKING = ("import os, signal, subprocess, sys; sys.path.insert(0, '.'); from benchmarks.links import link\n"
                      "real = subprocess.run\n"
                      "def run(argv, **kw):\n"
                      "    if tuple(argv[:3]) == ('ip', 'link', 'add'):\n"
                      "        print(f'rlws{os.getpid()}', flush=True); os.kill(os.getpid(), signal.SIGTERM)\n"
                      "    return real(argv, **kw)\n"
                      "subprocess.run = run\n"
                      "with link(2000):\n    print('linked', flush=True)")


@pytest.mark.skipif(bool(LINK_UNAVAILABLE), reason=LINK_UNAVAILABLE or "-")
def test_a_benchmark_stopped_while_making_its_link_leaves_no_namespace():
    proc = subprocess.Popen([sys.executable, "-c", TERM_WHILE_LINKING], cwd=REPO, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    tag = out.split()[0]
    assert tag.startswith("rlws") and "linked" not in out, out
    assert proc.returncode == 128 + signal.SIGTERM
    assert tag not in namespaces()


def test_a_count_argument_is_checked_as_it_is_read():
    from benchmarks.harness import at_least

    per_put = at_least(8, 8)
    assert per_put("64") == 64
    for bad in ("60", "0", "-8"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be 8 or more and a multiple of 8"):
            per_put(bad)
    with pytest.raises(ValueError):
        per_put("sixty")
    assert at_least(0)("0") == 0


@pytest.mark.parametrize("name, argument", [("broker_throughput", ["--per-put", "60"]),
                                            ("broker_throughput", ["--producers", "0"]),
                                            ("reward", ["--batch", "0"]), ("trainer", ["--steps", "-1"]),
                                            ("trainer_ab", ["--steps", "1"])])
def test_a_benchmark_refuses_a_bad_count_at_once_with_a_usage_error(name, argument):
    """`broker_throughput.py --per-put 60` made PUTs of 7 groups (56 trajectories) while its consumer waited for
    60 per PUT: it never ended."""
    proc = subprocess.run([sys.executable, f"benchmarks/{name}.py", *argument], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"argument {argument[0]}: must be" in proc.stderr, proc.stderr[-2000:]

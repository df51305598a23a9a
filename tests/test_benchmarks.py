"""Every benchmark runs in its smoke mode, exits by itself and ends with its JSON figures (the central ones
not null).

A benchmark that crashes at start or hangs at exit would otherwise only be
found when someone needs its figure. Each runs as a subprocess in its own
process group, which the test kills if it overruns. They run two at a time
(each test, while it waits for its own, starts the next as one ends).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

BENCHMARKS = {
    "broker_throughput": [],
    "reward": [],
    "trainer": ["--model", "{tiny}", "--world-size", "2", "--serve", "2"],
    "explorer": ["--model", "{tiny}"],
    "weight_sync": ["--model", "{tiny}"],
    "weight_sync_link": ["--model", "{tiny}", "--link-mbit", "2000"],
    "modes": ["--model", "{tiny}"],
    "streaming": ["--model", "{tiny}"],
    "learning": ["--model", "{tiny}"],
}
SCRIPTS = {"weight_sync_link": "weight_sync"}  # a second smoke of one script (the rest: the script of that name)
# Figures a smoke run must give (not null), so that a central figure cannot go missing unseen.
FIGURES = {"weight_sync": ("network_ratio", "delta_bytes_share"),
           "weight_sync_link": ("network_ratio", "delta_bytes_share"), "trainer": ("tokens_per_s", "serving")}
# The explorers' host is a network namespace: root and iproute2's ip and tc.
LINK_UNAVAILABLE = "" if os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc") else \
    "the link needs root, ip and tc"

SMOKE_TIMEOUT_S = 400
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
        if self.running:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class Smokes:
    """Every benchmark's smoke run, AT_ONCE at a time, moved on by whichever test is waiting."""

    def __init__(self, tiny: str, out_dir: Path):
        self.runs = {name: Smoke(name, tiny, out_dir) for name in sorted(BENCHMARKS)
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


@pytest.fixture(scope="module")
def smokes(tiny_model, tmp_path_factory):
    runs = Smokes(tiny_model, tmp_path_factory.mktemp("smokes"))
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

"""Every benchmark runs in its smoke mode, exits by itself and ends with its JSON figures.

A benchmark that crashes at start or hangs at exit would otherwise only be
found when someone needs its figure. Each runs as a subprocess in its own
process group, which the test kills if it overruns.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO

BENCHMARKS = {
    "broker_throughput": [],
    "reward": [],
    "trainer": ["--model", "{tiny}"],
    "explorer": ["--model", "{tiny}"],
    "weight_sync": ["--model", "{tiny}"],
    "modes": ["--model", "{tiny}"],
    "streaming": ["--model", "{tiny}"],
    "learning": ["--model", "{tiny}"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_smoke_mode_runs_and_exits(name, tiny_model):
    args = [a.format(tiny=tiny_model) for a in BENCHMARKS[name]]
    proc = subprocess.Popen([sys.executable, f"benchmarks/{name}.py", "--smoke", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{name} did not exit within 400 s: {err[-3000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    figures = json.loads(out.strip().splitlines()[-1])
    assert isinstance(figures, dict) and figures

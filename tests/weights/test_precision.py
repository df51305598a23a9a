"""Whether a CPU computes in bfloat16: its units, a timing of both dtypes, and the verdict a host keeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from structlog.testing import capture_logs

from rlbus.weights import precision
from tests.conftest import REPO


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "rlbus"


def timing(bfloat16_ms: float, float32_ms: float, calls: list | None = None):
    def measure():
        if calls is not None:
            calls.append(1)
        return {"float32_ms": float32_ms, "bfloat16_ms": bfloat16_ms}
    return measure


def test_a_cpu_without_bfloat16_units_takes_float32_and_is_not_timed(cache):
    def never():
        raise AssertionError("a CPU that emulates bfloat16 is not timed")

    assert precision.decide([], timing=never) == {"bfloat16": False, "units": []}
    assert not cache.exists()


@pytest.mark.parametrize("bfloat16_ms, float32_ms, taken", [(2.0, 8.0, True), (8.0, 10.0, True),
                                                             (8.1, 10.0, False), (7.4, 4.4, False)])
def test_bfloat16_is_taken_only_where_it_runs_at_least_a_quarter_faster(cache, bfloat16_ms, float32_ms, taken):
    verdict = precision.decide(["avx512_bf16"], timing=timing(bfloat16_ms, float32_ms))
    assert verdict["bfloat16"] is taken
    assert (verdict["units"], verdict["bfloat16_ms"], verdict["float32_ms"]) == (["avx512_bf16"], bfloat16_ms,
                                                                                 float32_ms)


def test_the_verdict_is_kept_per_host_and_read_back_without_timing_again(cache):
    calls: list = []
    first = precision.decide(["avx512_bf16"], timing=timing(7.4, 4.4, calls))
    again = precision.decide(["avx512_bf16"], timing=timing(1.0, 9.0, calls))
    assert again == first and not first["bfloat16"] and len(calls) == 1
    [kept] = cache.glob("cpu-bfloat16-*.json")
    assert json.loads(kept.read_text()) == first
    # Other units (another virtual machine of the same CPU model, say) are another host's verdict.
    other = precision.decide(["amx", "avx512_bf16"], timing=timing(1.0, 9.0, calls))
    assert other["bfloat16"] and len(calls) == 2 and len(list(cache.glob("cpu-bfloat16-*.json"))) == 2


@pytest.mark.parametrize("content", ["{not json", '{"bfloat16": "yes"}', "[]"])
def test_a_damaged_verdict_is_measured_again_and_replaced(cache, content):
    path = precision.verdict_path(["avx512_bf16"])
    path.parent.mkdir(parents=True)
    path.write_text(content)
    verdict = precision.decide(["avx512_bf16"], timing=timing(2.0, 8.0))
    assert verdict["bfloat16"] and json.loads(path.read_text()) == verdict


def test_a_cache_that_cannot_be_written_is_timed_without_it_and_said(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a directory cannot be made under a file
    with capture_logs() as logs:
        verdict = precision.decide(["avx512_bf16"], timing=timing(2.0, 8.0))
    assert verdict["bfloat16"]
    [warning] = [e for e in logs if e["event"] == "cpu_bfloat16_unkept"]
    assert warning["log_level"] == "warning" and str(blocker) in warning["path"]


def test_a_verdict_that_cannot_be_kept_is_still_taken_once_measured(monkeypatch, cache):
    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(precision.os, "replace", full)
    calls: list = []
    with capture_logs() as logs:
        verdict = precision.decide(["avx512_bf16"], timing=timing(2.0, 8.0, calls))
    assert verdict["bfloat16"] and len(calls) == 1
    assert [e["error"] for e in logs if e["event"] == "cpu_bfloat16_unkept"] == ["[Errno 28] No space left on device"]
    assert sorted(p.suffix for p in cache.iterdir()) == [".lock"]  # no verdict, no half-written file


def test_the_timing_runs_both_dtypes_for_real():
    times = precision.measure(rounds=2, rows=64, width=128)
    assert set(times) == {"float32_ms", "bfloat16_ms"} and all(t > 0 for t in times.values())


def test_processes_of_one_host_that_ask_at_once_take_one_verdict(tmp_path):
    """Three processes ask together, each with the real timing: one measures, the others wait and read its
    verdict (one `measured_at`, the same figures), so the trainer and explorers of a host agree."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    code = ("import json, sys, torch; from rlbus.weights.precision import decide; print('ready', flush=True); "
            "sys.stdin.readline(); print(json.dumps(decide(['avx512_bf16'])))")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        assert [proc.stdout.readline() for proc in procs] == ["ready\n"] * 3
        for proc in procs:  # all three ask now
            proc.stdin.write("\n")
            proc.stdin.flush()
        verdicts = [json.loads(proc.communicate(timeout=120)[0]) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert verdicts[0] == verdicts[1] == verdicts[2] and "measured_at" in verdicts[0]
    [kept] = (tmp_path / "cache" / "rlbus").glob("cpu-bfloat16-*.json")
    assert json.loads(kept.read_text()) == verdicts[0]

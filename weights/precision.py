"""Whether this CPU should compute in bfloat16: decided by its flags, then by a timing kept per host.

A CPU without AVX512-BF16 or AMX emulates bfloat16, many times slower than float32, and is never timed. One
that has them is timed: a 2-core Xeon whose virtual machine shows AVX512-BF16 but no AMX ran a bfloat16
matrix product in 1.6-1.9 times the float32 time, trained a micro-batch under bfloat16 autocast in 5.9-6.4 s
against 3.8-4.3 s, and learned the default job slower and ended lower in bfloat16. So `cpu_bfloat16()` times
the same product in both dtypes, alternated, and takes bfloat16 only where it runs at least `MARGIN` times
as fast: of two close choices, float32 is the exact one.

The verdict is kept in the cache directory, one file per CPU model, flags and torch version, written under a
lock: the trainer and the explorers of a host resolve `rollout.dtype: auto` apart and must agree on it, and
whichever asks first measures while the others wait and read. Delete the file to measure again.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import structlog

from rlbus.weights.models import cache_home

log = structlog.get_logger()

MARGIN = 1.25  # bfloat16 is taken where its product takes at most 1/MARGIN of float32's time
_PROBES = {"avx512_bf16": "_is_avx512_bf16_supported", "amx": "_is_amx_tile_supported"}  # torch.cpu's (private)


def native_units() -> list[str]:
    """The bfloat16 units this CPU has, as torch detects them; none: bfloat16 is emulated."""
    import torch

    return [unit for unit, probe in _PROBES.items() if getattr(torch.cpu, probe, bool)()]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def verdict_path(units: list[str]) -> Path:
    import torch

    key = json.dumps([_cpu_model(), sorted(units), torch.__version__])
    return cache_home() / f"cpu-bfloat16-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"


def measure(rounds: int = 7, rows: int = 512, width: int = 1024) -> dict[str, float]:
    """Median milliseconds of one (rows x width) @ (width x width) product in each dtype, the two alternated so
    that a change in the host's load falls on both."""
    import torch

    gen = torch.Generator().manual_seed(0)
    pair = [torch.randn(rows, width, generator=gen), torch.randn(width, width, generator=gen)]
    operands = {"float32": pair, "bfloat16": [t.to(torch.bfloat16) for t in pair]}
    times: dict[str, list[float]] = {name: [] for name in operands}
    for round_ in range(rounds + 1):
        for name, (a, b) in operands.items():
            start = time.perf_counter()
            torch.mm(a, b)
            if round_:  # the first round warms the kernels up
                times[name].append(1e3 * (time.perf_counter() - start))
    return {f"{name}_ms": round(statistics.median(t), 3) for name, t in times.items()}


def decide(units: list[str], timing=None) -> dict:
    """The verdict for a CPU with these bfloat16 units, read from the host's file or measured and written
    there: `{"bfloat16": bool, "units": [...], "float32_ms": ..., "bfloat16_ms": ..., "measured_at": unix time}`
    (the units only, for a CPU that has none)."""
    if not units:
        return {"bfloat16": False, "units": []}
    timing = timing or measure
    path, verdict = verdict_path(units), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            kept = _read(path)
            if kept is not None:
                return kept
            verdict = _measured(units, timing)
            _keep(path, verdict)
            return verdict
    except OSError as e:
        # Without the file each process of the host decides for itself, and they may differ: the broker then
        # refuses the one that differs, naming the dtype to set.
        log.warning("cpu_bfloat16_unkept", path=str(path), error=str(e))
        return verdict or _measured(units, timing)


def _keep(path: Path, verdict: dict) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(verdict))
        os.replace(tmp, path)  # whole or not at all, for a reader that takes no lock
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path) -> dict | None:
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return verdict if isinstance(verdict, dict) and isinstance(verdict.get("bfloat16"), bool) else None


def _measured(units: list[str], timing) -> dict:
    times = timing()
    return {"bfloat16": times["bfloat16_ms"] * MARGIN <= times["float32_ms"], "units": units, **times,
            "measured_at": round(time.time(), 3)}


@functools.cache
def cpu_bfloat16() -> dict:
    """This host's verdict, once per process (logged with what it rests on)."""
    verdict = decide(native_units())
    log.info("cpu_bfloat16", **verdict)
    return verdict

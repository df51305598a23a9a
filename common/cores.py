"""How long this process's threads waited for a core: the sign that something else runs on its cores.

Linux counts, for every thread, the time it ran and the time it was ready to
run but waited for a core (`/proc/self/task/TID/schedstat`, with
CONFIG_SCHED_INFO, which the usual distribution kernels have). rlbus's heavy
work runs on OpenMP threads (torch's in the trainer, the vLLM engine's in an
explorer), one per core by default, which split each operation into equal
parts and wait for the last: a part on a core that another process also wants
runs at a fraction of the core's speed, and every operation waits for it. On
a 2-core host beside one busy process, the default job's decode step took 19
times as long with 2 threads and its training step 12 times; with 1 thread,
as long as with 1 thread on a quiet host (README, "Sharing the cores").

`CoreWait.share()` is the share of its threads' runnable time since the last
call that they spent waiting for a core; explorers and the trainer log it
with each batch and step (`core_wait`) and, where that work runs on more than
one thread, say once in a warning what to do when it is over `WARN_SHARE`
twice in a row (once can be a start, where in `rlbus up` the explorer's first
batch runs while the trainer loads its model, or the trainer's checkpoint).
"""

from __future__ import annotations

import os
from pathlib import Path

import structlog

log = structlog.get_logger()

# The default job, quiet: medians 0.03 (trainer) and 0.10 (explorer), up to 0.51 at a checkpoint; beside yes: 0.50-0.56
WARN_SHARE = 0.25
TASKS = Path("/proc/self/task")


def thread_times() -> dict[int, tuple[int, int]]:
    """{thread id: (ns run, ns waited for a core)} of this process's live threads; empty where Linux does not say."""
    times = {}
    try:
        tids = os.listdir(TASKS)
    except OSError:
        return {}
    for tid in tids:
        try:
            run, wait, _ = (TASKS / tid / "schedstat").read_text().split()
        except (OSError, ValueError):
            continue  # the thread ended since the listing, or no schedstat
        times[int(tid)] = (int(run), int(wait))
    return times


class CoreWait:
    """The share of its threads' time this process waited for a core, interval by interval."""

    def __init__(self, setting: str, threads: int):
        self.setting = setting  # what the warning tells the user to set: trainer.threads, explorer.threads
        self.threads = threads  # the threads its heavy work is split over: one alone only shares its core out
        self._last = thread_times()
        self.over = 0  # intervals in a row over WARN_SHARE
        self.warned = False

    def share(self) -> float | None:
        """Since the last call (or the start): ns waited / (ns run + ns waited), summed over the threads alive now
        (a thread started since counts from its start); None where nothing ran or Linux does not say."""
        now = thread_times()
        run = wait = 0
        for tid, (r, w) in now.items():
            r0, w0 = self._last.get(tid, (0, 0))
            run, wait = run + max(0, r - r0), wait + max(0, w - w0)
        self._last = now
        if run + wait == 0:
            return None
        return wait / (run + wait)

    def measure(self) -> float | None:
        """`share()`, rounded for a log line, with the warning the first time it is over WARN_SHARE twice in a row
        (with more than one thread: a single one shares its core out, without others waiting on it)."""
        share = self.share()
        if share is None:
            return None
        self.over = self.over + 1 if share > WARN_SHARE else 0
        if self.over >= 2 and self.threads > 1 and not self.warned:
            self.warned = True
            log.warning("cores_shared", core_wait=round(share, 3), threads=self.threads,
                        hint=f"this process's threads waited for a core {share:.0%} of their time: another process "
                             f"runs on its cores, and OpenMP threads that share a core wait on each other at every "
                             f"operation (many times slower, not twice). Give it cores of its own (launch.*_cpus, "
                             f"taskset) or fewer threads ({self.setting}; 1 on a 2-core host)")
        return round(share, 3)

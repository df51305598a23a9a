"""`rlbus broker`: the broker process, from its config to its loop, until SIGTERM or SIGINT.

The process-wide settings live here rather than in the loop's module: signals, the metrics endpoint, and
the cyclic garbage collector. Every trajectory the broker holds is a few small objects (its header, an
index entry, a view of its payload), so CPython's default young-generation threshold (700 allocations)
would run the collector every few trajectories: 15% of the loop's busy time in the throughput benchmark,
2% with the threshold below (docs/architecture.md, "Measured").

The C allocator is told to keep what it frees (`keep_freed_memory`): the payload frames ZeroMQ receives
(hundreds of KB to MB each) are otherwise mapped afresh or handed back to the kernel as they come and go,
and every new page then costs a fault and its zeroing on the way in.
"""

from __future__ import annotations

import ctypes
import gc
import sqlite3
from pathlib import Path

import structlog

from rlbus.broker import catalog
from rlbus.broker.endpoints import BindError, InUse, hold
from rlbus.broker.metrics import serve_metrics
from rlbus.broker.server import Broker
from rlbus.common.config import RunConfig
from rlbus.common.processes import freeze_heap, on_stop_signals, refreeze_heap

log = structlog.get_logger()

GC_YOUNG_THRESHOLD = 50_000  # allocations between young-generation collections (CPython's default: 700)
MMAP_THRESHOLD = 32 << 20  # blocks under this come from the heap, not mmap (glibc: 128 KB, rising as it frees)
TRIM_THRESHOLD = 128 << 20  # free memory kept at a heap's top before it goes back (glibc: twice the above)


def keep_freed_memory() -> bool:
    """glibc's malloc: serve blocks of up to 32 MB from its heaps and keep up to 128 MB free at their tops,
    so that the frames of the PUTs in flight reuse the pages of the PUTs before them. By default glibc maps
    each block over 128 KB afresh and unmaps it when freed (the threshold rising only as they are freed),
    and gives a heap's top back past twice that: each frame then arrives in new pages. Measured with 256 KB
    trajectories, 8 a PUT (docs/architecture.md, "The allocator keeps what it frees"): half the page faults
    of ZeroMQ's receiving thread gone, the broker's CPU per byte about 12% lower. False where the C library
    is not glibc (nothing changed)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(-3, MMAP_THRESHOLD)) and bool(mallopt(-1, TRIM_THRESHOLD))  # M_MMAP_, M_TRIM_THRESHOLD


def run(cfg: RunConfig) -> None:
    """Serve until SIGTERM, SIGINT or SIGHUP."""
    keep_freed_memory()  # before ZeroMQ's threads allocate
    Path(cfg.buffer_dir()).mkdir(parents=True, exist_ok=True)
    try:
        lock = hold(cfg.buffer_dir())  # noqa: F841  (held until the process ends)
    except InUse as exc:
        log.error("broker_dir_in_use", error=str(exc))
        raise SystemExit(1) from None
    try:
        broker = Broker(cfg)
    except BindError as exc:  # a port in use, an address not of this host: said in one line, exit 1
        log.error("broker_bind_failed", error=str(exc))
        raise SystemExit(1) from None
    except sqlite3.DatabaseError as exc:  # its catalogue damaged, or of something else
        log.error("broker_catalogue_unreadable", error=f"{Path(cfg.buffer_dir()) / catalog.FILE}: {exc}; move the "
                  "buffer directory aside (it holds the run's data) or give another buffer.dir")
        raise SystemExit(1) from None
    tasks, wanted = len(broker.tasks.taskset), cfg.trainer.total_steps * cfg.data.batch_tasks
    if 0 < tasks < wanted:  # a finite taskset (0: endless) that cannot fill the run: it ends when they are done
        log.warning("taskset_short", tasks=tasks, tasks_wanted=wanted, steps=-(-tasks // cfg.data.batch_tasks),
                    total_steps=cfg.trainer.total_steps, note="the run ends once they are trained on")
    freeze_heap()  # what start-up built (modules, the index restored from disk) is never scanned again
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)
    serve_metrics(broker)
    on_stop_signals(broker.stop)
    broker.serve()
    refreeze_heap()  # the index grown since start-up: the interpreter's teardown need not walk it

"""What every rlbus process does as a process.

`rlbus up` starts its components, and a sharded `rlbus trainer` its ranks, as
children that must go when the parent goes, even when it is SIGKILLed and
has no chance to stop them: Linux's PR_SET_PDEATHSIG sends them SIGTERM.

Every long-running process stops on SIGTERM, SIGINT or SIGHUP through
`on_stop_signals`, and processes that load torch, transformers or vLLM start
with the cyclic collector off (`rlbus explorer`, `trainer` and `reward` turn
it off first thing) and freeze their heap once started (`freeze_heap`), so
that the collector never stalls their threads (and again as they end,
`refreeze_heap`, where a library unfroze it). The
interpreter's teardown does not collect a frozen heap, and triton's nanobind
bindings (torch and vLLM load triton) then report the objects it still holds
as leaked, thirty lines at every exit of a trainer or an explorer: where
triton was loaded, what the teardown writes after every exit handler goes to
/dev/null (`quiet_teardown`). `rlbus trainer` asks for huge pages for its
large tensors before torch loads (`tensor_huge_pages`). Why a trainer or an
explorer ended is the last event of its log (`failures_logged`).
"""

from __future__ import annotations

import atexit
import fcntl
import gc
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable, Iterator

import structlog

from rlbus.common.config import ConfigError
from rlbus.common.connection import BrokerError, NoWelcome, StoppedBeforeWelcome


TRACEBACK_LOGGED = "rlbus_traceback_logged"  # set on an exception whose traceback failures_logged has logged


@contextmanager
def failures_logged(event: str) -> Iterator[None]:
    """Log why the process ends, if it fails inside, as `event` (e.g. `trainer_failed`), then raise again: one line
    in the log file for a setting it cannot use, no broker or the broker's refusal (which the command prints as
    its `error: ...` line, so it is not said twice on stderr); the traceback, everywhere, for anything else, with
    its message whole in `error` (up to 1000 characters: `rlbus up` and `rlbus logs` show it)."""
    log = structlog.get_logger()
    try:
        yield
    except StoppedBeforeWelcome:  # told to stop before the broker answered: nothing failed
        raise
    except (ConfigError, NoWelcome, BrokerError) as exc:
        log.error(event, error=str(exc), file_only=True)
        raise
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        log.exception(event, error=said if len(said) <= 1000 else f"{said[:1000]}...")
        setattr(exc, TRACEBACK_LOGGED, True)  # the command ends with exit 1 without printing it again
        raise


def _prctl(*args) -> bool:
    """prctl(2) where the C library has it (Linux); False where it does not."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(*args)
    except (OSError, AttributeError):
        return False
    return True


def terminate_with(parent: int) -> None:
    """In a child, before exec: get SIGTERM when `parent` dies, even by SIGKILL (elsewhere than Linux: nothing)."""
    if _prctl(1, signal.SIGTERM) and os.getppid() != parent:  # PR_SET_PDEATHSIG; it died before the call
        os.kill(os.getpid(), signal.SIGTERM)


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` in the OS too (its first 15 bytes), where `top -H`, `ps -L` and
    /proc/PID/task/TID/comm show it; Python before 3.14 leaves every thread named after the process."""
    _prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_stop_requested = threading.Event()


def quiet_teardown() -> None:
    """Register, first so that it runs last, an exit handler that sends the interpreter's teardown output to
    /dev/null if triton was loaded. What a process says while it stops (its logs, other exit handlers) is
    written before it; an uncaught exception's traceback too."""
    atexit.register(_silence_teardown)


def _silence_teardown() -> None:
    if "triton" not in sys.modules:
        return
    try:
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed or broken stderr: nothing to flush
        pass
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)


def stop_requested() -> bool:
    """Whether a stop signal reached this process since `on_stop_signals` (for waits that precede a component's
    own loop, such as a broker client's start)."""
    return _stop_requested.is_set()


def on_stop_signals(stop: Callable[[], None]) -> None:
    """Call `stop()` on SIGTERM, SIGINT and SIGHUP, on a thread of its own; call from the main thread.

    Python runs a signal's handler in the main thread between two bytecodes, wherever that thread is: inside
    `threading.Event.wait`, it holds the event's lock, and a handler that sets the same event waits for that
    lock for ever. So the handler only writes a byte to a pipe (a system call, no lock), and a thread that
    reads the pipe calls `stop()`: once per byte, so `stop` must not mind being called again.

    The kernel may deliver the signal to any of the process's threads, and then the handler waits for the main
    thread's next bytecode: never, while that thread blocks in a C call such as a ZeroMQ poll (the broker's
    waits up to half a heartbeat interval). The pipe is also the interpreter's wakeup fd, which its C-level
    handler writes to at once, on whichever thread the signal came; the handler's own byte stays for a library
    that takes the wakeup fd for itself.
    """
    readable, writable = os.pipe()
    os.set_blocking(writable, False)  # a flood of signals fills the pipe: the bytes beyond say nothing new
    signal.set_wakeup_fd(writable, warn_on_full_buffer=False)
    os.register_at_fork(after_in_child=_forget_wakeup_fd)

    def relay() -> None:
        while os.read(readable, 1):
            _stop_requested.set()
            stop()

    threading.Thread(target=relay, name="stop-signals", daemon=True).start()

    def handler(signum: int, frame: object) -> None:
        try:
            os.write(writable, b"\0")
        except BlockingIOError:
            pass

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


def _forget_wakeup_fd() -> None:
    """A child forked without exec (multiprocessing's fork) has the pipe too: its own signals must not stop the
    parent through it."""
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # not its main thread: nothing this hook can do
        pass


class Waker:
    """A pipe that a loop polls beside its sockets (`fileno`), so that `wake` from another thread (a stop
    signal's) ends its poll at once rather than at the poll's timeout. Once woken it stays readable: for a loop's
    end. `wake` after `close` does nothing (the descriptors may be another file's by then)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.fileno, self._writable = os.pipe()
        os.set_blocking(self._writable, False)
        self._open = True

    def wake(self) -> None:
        with self._lock:
            if self._open:
                try:
                    os.write(self._writable, b"\0")
                except BlockingIOError:  # full: readable already
                    pass

    def close(self) -> None:
        with self._lock:
            if self._open:
                self._open = False
                os.close(self.fileno)
                os.close(self._writable)


def freeze_heap() -> None:
    """Call once a process has started up: what start-up built is never scanned by the cyclic collector again.

    torch, transformers and vLLM leave about 720,000 tracked objects behind their imports and a loaded engine.
    Every full collection walks all of them while it holds the GIL (measured on a 2-core host: 0.1-0.5 s in an
    explorer, up to 1.1 s in a test process with both cores busy), and no other thread of the process runs
    meanwhile, its broker client's heartbeats included (a peer silent for `broker.liveness` heartbeats is
    dropped). Frozen, they are left out of every collection. The collector is on again afterwards: the
    processes that call this turn it off as they start (`rlbus.cli`), since their imports build those objects
    with nearly no garbage and every automatic full collection on the way walks all that were built before it
    (on a 2-core host, importing torch and vLLM's `LLM` took 14.4-15.3 s with the collector on and 11.2-12.2 s
    with it off); the event says whether it was off (`deferred`).
    """
    started, deferred = time.monotonic(), not gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.enable()
    structlog.get_logger().info("heap_frozen", objects=gc.get_freeze_count(), deferred=deferred,
                                seconds=round(time.monotonic() - started, 3))


@contextmanager
def heap_kept_frozen() -> Iterator[None]:
    """Within, `gc.unfreeze` does nothing: for a library's shutdown in a process that ends next. vLLM's engine
    shutdown unfreezes the whole heap and then runs two full collections over it, to free what a process that
    goes on would otherwise keep (cyclic garbage among frozen objects is never freed): with an explorer's
    720,000 objects they took about 2 s of the engine's 2.4 s close on a 2-core host. Kept frozen, they walk
    only what was made since the freeze."""
    unfreeze = gc.unfreeze
    gc.unfreeze = lambda: None
    try:
        yield
    finally:
        gc.unfreeze = unfreeze


def refreeze_heap() -> None:
    """Call as a process ends, after a library has unfrozen its heap (vLLM's engine shutdown unfreezes the whole
    heap, not only what vLLM froze) or where it grew since `freeze_heap` (the broker's index). The interpreter's
    teardown runs several full collections; frozen, the heap is left out of them: an explorer's exit after its
    engine closed took about 3 s, and takes 0.3 s so."""
    gc.freeze()
    structlog.get_logger().info("heap_frozen", objects=gc.get_freeze_count(), ending=True)


def tensor_huge_pages() -> None:
    """Ask PyTorch's CPU allocator for transparent huge pages for every tensor of 2 MB or more
    (`THP_MEM_ALLOC_ENABLE`: torch reads it once, at its first allocation, so call this before torch is
    imported). A training step allocates and frees blocks of up to a hundred MB (the embedding's gradient, the
    logits and their gradients), which the C library maps afresh each time: every 4 KB page of them faulted
    in and zeroed on first touch (in a profiled step of the default task on a 2-core host, `fill_` and `copy_`
    took a quarter of its CPU time); a huge page is one fault for 512 of them. The default job's training
    compute came out 6.6% lower, bitwise the same (docs/architecture.md, "Huge pages for the trainer's
    tensors"). Where the kernel grants none (mode `never`), nothing changes.
    An environment that sets the variable itself (to 0, say) is left as it is."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


class Held(RuntimeError):
    """Another running process holds the lock; `pid` is the one it wrote in the lock file."""

    def __init__(self, path: Path, pid: str):
        super().__init__(f"{path} is held by pid {pid}")
        self.pid = pid


def hold_lock(path: str | Path) -> IO[str]:
    """An exclusive lock on `path` (flock, the file made if need be) with this process's pid in it, held while the
    returned file stays open; the lock goes with the process however it ends. Held if another process has it."""
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise Held(Path(path), holder) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f

"""The communicators a broadcast epoch builds, behind one small interface: `make_comm(..., alive)` (the
rendezvous), `broadcast(bucket, alive)` and `close()`, every wait bounded by the epoch's timeout and cut short
when `alive` (the caller's check that the other end is still there) raises.

- `gloo`: torch.distributed's ProcessGroupGloo over TCP, CPU tensors.
- `nccl`: cupy's NCCL binding, CUDA tensors, with a stream polled until a
  deadline and the communicator aborted past it.

A gloo operation given up that way cannot be aborted (`ProcessGroupGloo.abort()`, and the group's teardown,
wait for it): its group is kept until the operation ends at its own timeout, and at exit a group whose
operation still waits is left undestroyed, so that the process ends at once instead of waiting it out.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import threading
import time
from typing import Any, Callable

import msgpack

ALIVE_EVERY_S = 0.5  # while a wait goes on, how often it checks that the other end is still there


class BroadcastError(RuntimeError):
    """A broadcast or its rendezvous failed or ran past its deadline; the epoch is over."""


_ABANDONED: list = []  # (group, operation): gloo groups given up while an operation still waited


def _rendezvous(build: Callable[[], Any], alive: Callable[[], None] | None):
    """What `build()` (a blocking rendezvous, bounded by its own timeout) returns; given up on as soon as `alive`,
    asked every ALIVE_EVERY_S meanwhile, raises. A rendezvous cannot be cut short: one given up on goes on in its
    thread until it ends, and what it built then, if anything, is let go."""
    if alive is None:
        return build()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["made"] = build()
        except Exception as exc:  # raised in the caller's thread below
            box["error"] = exc

    worker = threading.Thread(target=run, daemon=True, name="rlbus-rendezvous")
    worker.start()
    while worker.is_alive():
        worker.join(ALIVE_EVERY_S)
        if worker.is_alive():
            alive()
    if "error" in box:
        raise box["error"]
    return box["made"]


def await_key(store, key: str, timeout_s: float, alive: Callable[[], None] | None = None) -> bytes:
    """`key`'s value in the epoch's store once it is set, within `timeout_s`; asked for every 10 ms at first and
    every ALIVE_EVERY_S at most, with `alive` (which raises to give up) asked every ALIVE_EVERY_S meanwhile.
    (`TCPStore.wait` in slices would do the same, but logs a warning each time a slice runs out.)"""
    now = time.monotonic()
    deadline, check, pause = now + timeout_s, now + ALIVE_EVERY_S, 0.01
    while not store.check([key]):
        now = time.monotonic()
        if now >= deadline:
            raise BroadcastError(f"no {key!r} in the epoch's store within {timeout_s} s")
        if alive is not None and now >= check:
            alive()
            check = now + ALIVE_EVERY_S
        time.sleep(min(pause, deadline - now))
        pause = min(2 * pause, ALIVE_EVERY_S)
    return store.get(key)


class GlooComm:
    """torch.distributed's gloo, over TCP, for CPU tensors; its own group, built from the epoch's store."""

    device = "cpu"

    def __init__(self, store, rank: int, world: int, timeout_s: float, host: str,
                 alive: Callable[[], None] | None = None):
        from torch.distributed import ProcessGroupGloo

        _ABANDONED[:] = [a for a in _ABANDONED if not a[1].is_completed()]  # ended (at their timeout at the latest)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        opts = ProcessGroupGloo._Options()
        opts._timeout = self.timeout
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
        try:
            self.pg = _rendezvous(lambda: ProcessGroupGloo(store, rank, world, opts), alive)
        except RuntimeError as exc:
            raise BroadcastError(f"gloo rendezvous failed (rank {rank} of {world}): {exc}") from exc

    def broadcast(self, bucket, alive: Callable[[], None] | None = None) -> None:
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        deadline = time.monotonic() + self.timeout.total_seconds()
        work = self.pg.broadcast([bucket], opts)
        while True:
            # Waited in slices: gloo does not always see a sender that died mid-broadcast, nor ever a member that
            # stopped, and would then wait out the whole timeout. A wait that runs out leaves the operation going.
            try:
                work.wait(datetime.timedelta(seconds=ALIVE_EVERY_S) if alive else self.timeout)
                return
            except RuntimeError as exc:
                if work.is_completed():  # it ended as the slice ran out ("Operation timed out!"): its own outcome
                    try:
                        work.wait()
                        return
                    except RuntimeError as failed:
                        raise BroadcastError(f"gloo broadcast failed: {failed}") from failed
                if alive is None or time.monotonic() > deadline:
                    raise BroadcastError(f"gloo broadcast failed: {exc}") from exc
            try:
                alive()
            except BroadcastError:
                # The operation still waits, and aborting the group would wait with it: it is left to end at
                # its own timeout, the group kept meanwhile (its teardown would wait too; at exit it is left
                # undestroyed, `_leave_abandoned`).
                _ABANDONED.append((self.pg, work))
                self.pg = None
                raise

    def close(self) -> None:
        pg, self.pg = getattr(self, "pg", None), None
        if pg is not None:
            try:
                pg.abort()
            except RuntimeError:
                pass


class NcclComm:
    """cupy's NCCL binding, GPU to GPU. Rank 0 puts the unique id in the epoch's store."""

    device = "cuda"

    def __init__(self, store, rank: int, world: int, timeout_s: float, host: str = "",
                 alive: Callable[[], None] | None = None):
        from cupy.cuda import nccl

        self.nccl = nccl
        self.timeout_s = timeout_s
        if rank == 0:
            uid = nccl.get_unique_id()
            store.set("nccl_uid", msgpack.packb(list(uid) if not isinstance(uid, bytes) else uid))
        else:
            raw = msgpack.unpackb(await_key(store, "nccl_uid", timeout_s, alive))
            uid = tuple(raw) if isinstance(raw, list) else raw
        box: dict[str, Any] = {}

        def init() -> None:
            try:
                box["comm"] = nccl.NcclCommunicator(world, uid, rank)
            except Exception as exc:  # reported below, in the caller's thread
                box["error"] = exc

        worker = threading.Thread(target=init, daemon=True, name="nccl-init")
        worker.start()
        deadline = time.monotonic() + timeout_s
        while worker.is_alive() and time.monotonic() < deadline:
            worker.join(min(ALIVE_EVERY_S, max(0.0, deadline - time.monotonic())))
            if alive is not None and worker.is_alive():
                alive()
        if "comm" not in box:
            raise BroadcastError(f"NCCL init (rank {rank} of {world}) failed or took over {timeout_s} s: "
                                 f"{box.get('error', 'timed out')}")
        self.comm = box["comm"]

    def broadcast(self, bucket, alive: Callable[[], None] | None = None) -> None:
        import torch

        stream = torch.cuda.current_stream()
        self.comm.bcast(bucket.data_ptr(), bucket.numel(), self.nccl.NCCL_UINT8, 0, stream.cuda_stream)
        started = time.monotonic()
        deadline, check = started + self.timeout_s, started + ALIVE_EVERY_S
        while not stream.query():
            now = time.monotonic()
            if now > deadline:
                self.comm.abort()
                raise BroadcastError(f"NCCL broadcast of {bucket.numel()} bytes ran past {self.timeout_s} s; aborted")
            if alive is not None and now > check:
                check = now + ALIVE_EVERY_S
                try:
                    alive()
                except BroadcastError:
                    self.comm.abort()
                    raise
            time.sleep(0.001)
        self.comm.check_async_error()

    def close(self) -> None:
        comm, self.comm = getattr(self, "comm", None), None
        if comm is not None:
            comm.destroy()


BACKENDS = {"gloo": GlooComm, "nccl": NcclComm}


def make_comm(backend: str, store, rank: int, world: int, timeout_s: float, host: str,
              alive: Callable[[], None] | None = None):
    """The epoch's communicator for this rank, once every rank has joined; with `alive`, given up on as soon as it
    raises (asked every ALIVE_EVERY_S while the rendezvous waits)."""
    try:
        cls = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown broadcast backend {backend!r}; expected one of {sorted(BACKENDS)}") from None
    return cls(store, rank, world, timeout_s, host, alive)


def unavailable(backend: str) -> str | None:
    """Why `backend` cannot run in this process, or None when it can."""
    if backend == "gloo":
        return None
    if backend != "nccl":
        return f"unknown broadcast backend {backend!r}; expected one of {sorted(BACKENDS)}"
    try:
        from cupy.cuda import nccl  # noqa: F401
    except ImportError as exc:
        return f"the nccl backend needs cupy with NCCL (pip install cupy-cuda12x nvidia-nccl-cu12): {exc}"
    import torch

    if not torch.cuda.is_available():
        return "the nccl backend needs a CUDA device; use broadcast_backend gloo on CPU"
    return None


def resolve_backend(name: str) -> str:
    """`auto`: nccl where CUDA and cupy are present, else gloo."""
    if name != "auto":
        return name
    return "nccl" if unavailable("nccl") is None else "gloo"


@atexit.register
def _leave_abandoned() -> None:
    """Keep the groups whose operation still waits from being destroyed at exit: their teardown would wait for
    the operation (measured: a root that gave up on a stopped member ended 42.6 s later with a 40 s timeout,
    at once with its group left undestroyed)."""
    for group, work in _ABANDONED:
        if not work.is_completed():
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))

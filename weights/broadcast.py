"""Broadcasting weights from the trainer to explorers' vLLM workers, one sync epoch at a time.

Everything here is shared by both ends and both backends:

- `Layout`: the weights as a few flat byte buckets (`bucket_mb` each at
  most) and a manifest of (name, dtype, shape, bucket, offset). The trainer
  snapshots into the buckets (one memory copy); members receive into
  buckets of the same sizes and load views of them.
- Rendezvous: the trainer serves one `TCPStore` for the run. Epoch E lives
  under the prefix `e{E}/`: the manifest, then the communicator's own
  rendezvous, then one `done/{version}/{rank}` key per member that received
  a version whole. Each epoch builds its own communicator from that store;
  there is no global default group, so groups come and go with membership.
- Backends behind one small interface (`broadcast(bucket, alive)`, `close()`,
  every wait bounded by the epoch's timeout, and cut short when `alive`
  says the sender is gone):
  `gloo` (torch.distributed's ProcessGroupGloo over TCP, CPU tensors) and
  `nccl` (cupy's NCCL binding, CUDA tensors, with a stream polled until a
  deadline and the communicator aborted past it).
- `bucket_digest`: xxh3 (or BLAKE2b) over the buckets' bytes, so a member
  checks what it received before its policy version moves.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import msgpack

from rlbus.weights.digest import hasher, default_algorithm

ALIGN = 64  # bytes; every tensor view starts on a multiple of this
ALIVE_EVERY_S = 0.5  # while a member waits for a bucket, how often it checks that the trainer is still there


class BroadcastError(RuntimeError):
    """A broadcast or its rendezvous failed or ran past its deadline; the epoch is over."""


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Layout:
    entries: tuple[Entry, ...]
    bucket_sizes: tuple[int, ...]

    @classmethod
    def plan(cls, tensors: list[tuple[str, Any]], bucket_bytes: int) -> "Layout":
        """Pack tensors, in order, into buckets of at most `bucket_bytes` (a larger tensor gets one of its own)."""
        entries, sizes, used = [], [], None
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            if used is None or (used > 0 and used + nbytes > bucket_bytes):
                sizes.append(0)
                used = 0
            entries.append(Entry(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), len(sizes) - 1,
                                 used, nbytes))
            used = -(-(used + nbytes) // ALIGN) * ALIGN
            sizes[-1] = used
        return cls(tuple(entries), tuple(sizes))

    def to_bytes(self) -> bytes:
        return msgpack.packb({"entries": [[e.name, e.dtype, list(e.shape), e.bucket, e.offset, e.nbytes]
                                          for e in self.entries], "buckets": list(self.bucket_sizes)})

    @classmethod
    def from_bytes(cls, data: bytes) -> "Layout":
        d = msgpack.unpackb(data)
        return cls(tuple(Entry(n, dt, tuple(s), b, o, nb) for n, dt, s, b, o, nb in d["entries"]),
                   tuple(d["buckets"]))

    @property
    def nbytes(self) -> int:
        return sum(self.bucket_sizes)

    def allocate(self, device: str = "cpu") -> list:
        import torch

        return [torch.empty(n, dtype=torch.uint8, device=device) for n in self.bucket_sizes]

    def views(self, buckets: list) -> Iterator[tuple[str, Any]]:
        """(name, tensor) for every entry, as views of the buckets (no copy)."""
        import torch

        for e in self.entries:
            raw = buckets[e.bucket][e.offset:e.offset + e.nbytes]
            yield e.name, raw.view(getattr(torch, e.dtype)).view(e.shape)

    def fill(self, buckets: list, tensors: dict[str, Any]) -> None:
        """Copy tensors into their places in the buckets (casting to the layout's dtype)."""
        for name, view in self.views(buckets):
            view.copy_(tensors[name])


def unique_tensors(state: dict[str, Any]) -> list[tuple[str, Any]]:
    """State-dict entries with tied duplicates dropped (the first name of a shared tensor is kept)."""
    seen, out = set(), []
    for name, t in state.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out.append((name, t))
    return out


def bucket_digest(buckets: list, algorithm: str | None = None) -> str:
    algorithm = algorithm or default_algorithm()
    h = hasher(algorithm)
    for b in buckets:
        h.update(memoryview(b.cpu().numpy()))
    return f"{algorithm}:{h.hexdigest()}"


def local_address_towards(host: str) -> str:
    """This host's address on the route to `host`, of its family (gloo pairs only addresses of one family); no
    packet is sent."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as s:
            s.connect(address)
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def serve_store(host: str, port: int, timeout_s: float):
    """The trainer's rendezvous store for the run; returns (store, port)."""
    from torch.distributed import TCPStore

    store = TCPStore(host, port, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, store.port  # port 0: the one the store bound


def epoch_store(address: str, epoch: int, timeout_s: float, store=None):
    """The prefixed view of the run's store for one epoch (connecting to it unless `store` is given)."""
    from torch.distributed import PrefixStore, TCPStore

    if store is None:
        host, _, port = address.rpartition(":")
        store = TCPStore(host, int(port), None, False, datetime.timedelta(seconds=timeout_s))
    return PrefixStore(f"e{epoch}", store), store


# ---- backends ---------------------------------------------------------------


_ABANDONED: list = []  # (group, operation): gloo groups given up while an operation still waited


class GlooComm:
    """torch.distributed's gloo, over TCP, for CPU tensors; its own group, built from the epoch's store."""

    device = "cpu"

    def __init__(self, store, rank: int, world: int, timeout_s: float, host: str):
        from torch.distributed import ProcessGroupGloo

        _ABANDONED[:] = [a for a in _ABANDONED if not a[1].is_completed()]  # ended (at their timeout at the latest)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        opts = ProcessGroupGloo._Options()
        opts._timeout = self.timeout
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
        try:
            self.pg = ProcessGroupGloo(store, rank, world, opts)
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
            # Waited in slices: gloo does not always see a sender that died mid-broadcast, and would then wait
            # out the whole timeout. A wait that runs out leaves the operation going.
            try:
                work.wait(datetime.timedelta(seconds=ALIVE_EVERY_S) if alive else self.timeout)
                return
            except RuntimeError as exc:
                if alive is None or work.is_completed() or time.monotonic() > deadline:
                    raise BroadcastError(f"gloo broadcast failed: {exc}") from exc
            try:
                alive()
            except BroadcastError:
                # The operation still waits, and aborting the group would wait with it: it is left to end at
                # its own timeout, the group kept meanwhile (its teardown would wait too; so does this
                # process's exit, if it comes first).
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

    def __init__(self, store, rank: int, world: int, timeout_s: float, host: str = ""):
        from cupy.cuda import nccl

        self.nccl = nccl
        self.timeout_s = timeout_s
        if rank == 0:
            uid = nccl.get_unique_id()
            store.set("nccl_uid", msgpack.packb(list(uid) if not isinstance(uid, bytes) else uid))
        else:
            store.wait(["nccl_uid"], datetime.timedelta(seconds=timeout_s))
            raw = msgpack.unpackb(store.get("nccl_uid"))
            uid = tuple(raw) if isinstance(raw, list) else raw
        box: dict[str, Any] = {}

        def init() -> None:
            try:
                box["comm"] = nccl.NcclCommunicator(world, uid, rank)
            except Exception as exc:  # reported below, in the caller's thread
                box["error"] = exc

        worker = threading.Thread(target=init, daemon=True, name="nccl-init")
        worker.start()
        worker.join(timeout_s)
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


def make_comm(backend: str, store, rank: int, world: int, timeout_s: float, host: str):
    try:
        cls = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown broadcast backend {backend!r}; expected one of {sorted(BACKENDS)}") from None
    return cls(store, rank, world, timeout_s, host)


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


# ---- the member's side ------------------------------------------------------


class Member:
    """One explorer's (one vLLM worker's) place in the current epoch: its communicator and buckets."""

    def __init__(self, ann: dict[str, Any], device: str | None = None):
        self.epoch = ann["epoch"]
        self.key = (ann["address"], ann["epoch"])  # with the trainer that built it (`holds`)
        self.rank = ann["rank"]
        self.timeout_s = ann["timeout_s"]
        host = local_address_towards(ann["address"].rpartition(":")[0])
        self.store, self._root_store = epoch_store(ann["address"], self.epoch, self.timeout_s)
        try:
            self.store.wait(["layout"], datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise BroadcastError(f"epoch {self.epoch}: no layout in the store: {exc}") from exc
        self.layout = Layout.from_bytes(self.store.get("layout"))
        self.comm = make_comm(ann["backend"], self.store, self.rank, ann["world"], self.timeout_s, host)
        self.buckets = self.layout.allocate(device or self.comm.device)

    def alive(self) -> None:
        """Raise BroadcastError unless the trainer that built this place is still there: its store, on the
        connection this place was built over, answers (a restarted trainer at the same address is a new one)."""
        try:
            self.store.check(["layout"])
        except (RuntimeError, OSError) as exc:  # torch's DistNetworkError is a RuntimeError
            raise BroadcastError(f"epoch {self.epoch}: the trainer's store no longer answers (the trainer stopped "
                                 f"or restarted): {str(exc).splitlines()[0] if str(exc) else exc!r}") from exc

    def holds(self, ann: dict[str, Any]) -> bool:
        """Whether this is a place in the announced epoch: the same address and epoch, and the same trainer
        (`alive`). A restarted trainer counts its epochs from 1 again, on the same address when
        sync.rendezvous_port fixes its port."""
        if self.key != (ann["address"], ann["epoch"]):
            return False
        try:
            self.alive()
        except BroadcastError:
            return False
        return True

    def receive(self, version: int, digest: str) -> dict[str, float]:
        """Receive every bucket of `version` and check the digest; returns seconds spent."""
        started = time.monotonic()
        for bucket in self.buckets:
            self.comm.broadcast(bucket, self.alive)
        received = time.monotonic()
        actual = bucket_digest(self.buckets, digest.partition(":")[0] or None)
        if actual != digest:
            raise BroadcastError(f"version {version}: received weights have digest {actual}, expected {digest}")
        self.store.set(f"done/{version}/{self.rank}", b"1")
        return {"receive_s": received - started, "digest_s": time.monotonic() - received}

    def close(self) -> None:
        self.comm.close()


def receive_version(worker: Any, ann: dict[str, Any], rank: int, info: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Inside an engine worker: receive the announced version as rank `rank` of its epoch, check its digest,
    and return its tensors (views of the received buckets).

    The worker keeps its place in the epoch (`worker._rlbus_member`: communicator and buckets) between
    versions and builds a new one when the epoch changes. Everything is received and checked before this
    returns; on any failure the place is dropped, so the next announcement starts clean.
    """
    member = getattr(worker, "_rlbus_member", None)
    if member is not None and not member.holds(ann):
        member.close()
        member = worker._rlbus_member = None
    started = time.monotonic()
    try:
        if member is None:
            device = str(getattr(worker, "device", "")) or None
            member = worker._rlbus_member = Member(dict(ann, rank=rank),
                                                   device=device if device and device.startswith("cuda") else None)
        joined = time.monotonic()
        info.update(member.receive(ann["version"], ann["digest"]))
    except Exception:
        if member is not None:
            member.close()
        worker._rlbus_member = None
        raise
    info.update(join_s=joined - started, tensors=len(member.layout.entries))
    return iter(member.layout.views(member.buckets))

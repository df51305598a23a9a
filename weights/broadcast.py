"""Broadcasting weights from the trainer to explorers' vLLM workers, one sync epoch at a time.

Everything here is shared by both ends and both backends:

- `Layout`: the weights as a few flat byte buckets (`bucket_mb` each at
  most) and a manifest of (name, dtype, shape, bucket, offset). The trainer
  snapshots into the buckets (one memory copy); members receive into
  buckets of the same sizes and load views of them.
- Rendezvous: the trainer serves one `TCPStore` for the run. Epoch E lives
  under the prefix `e{E}/`: the manifest, then the communicator's own
  rendezvous, then one `done/{version}/{rank}` key per member that received
  a version whole, and `aborted` if the trainer gives up on the epoch. Each
  epoch builds its own communicator from that store; there is no global
  default group, so groups come and go with membership.
- The communicators (rlbus.weights.comm): gloo over TCP for CPU tensors,
  NCCL for CUDA ones, each wait bounded by the epoch's timeout and cut short
  when the other end is gone.
- `bucket_digest`: xxh3 (or BLAKE2b) over the buckets' bytes, so a member
  checks what it received before its policy version moves.
"""

from __future__ import annotations

import datetime
import socket
import time
from dataclasses import dataclass
from typing import Any, Iterator

import msgpack

from rlbus.weights.comm import BroadcastError, make_comm
from rlbus.weights.digest import hasher, default_algorithm

ALIGN = 64  # bytes; every tensor view starts on a multiple of this


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
        # The rendezvous on a connection of its own: one given up on waits on it until its timeout, and every
        # call on a store connection waits for the one before it (`alive` asks on `self.store`).
        rendezvous, _ = epoch_store(ann["address"], self.epoch, self.timeout_s)
        self.comm = make_comm(ann["backend"], rendezvous, self.rank, ann["world"], self.timeout_s, host, self.alive)
        self.buckets = self.layout.allocate(device or self.comm.device)

    def alive(self) -> None:
        """Raise BroadcastError unless the trainer that built this place is still there and still broadcasting in
        this epoch: its store, on the connection this place was built over, answers (a restarted trainer at the
        same address is a new one), and has no `aborted` key for the epoch (the trainer gave up on it while this
        member waited, and has moved on to another)."""
        try:
            aborted = self.store.check(["layout"]) and self.store.check(["aborted"])
        except (RuntimeError, OSError) as exc:  # torch's DistNetworkError is a RuntimeError
            raise BroadcastError(f"epoch {self.epoch}: the trainer's store no longer answers (the trainer stopped "
                                 f"or restarted): {str(exc).splitlines()[0] if str(exc) else exc!r}") from exc
        if aborted:
            raise BroadcastError(f"epoch {self.epoch}: the trainer aborted it")

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

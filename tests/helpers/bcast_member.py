"""A broadcast member in a plain process (no vLLM), for the broadcast tests and benchmark.

`Root`: the trainer's end of one epoch, in the caller's process.
`receive(ann, rank, versions, out)`: join the announced epoch, receive
`versions` versions, put (version, fingerprints of the tensors) on `out`.
`receive_then_die(ann, rank, out)`: receive the first bucket only, say so, and
wait to be killed. `send_then_die(world, timeout_s, ann_out, out)`: the
trainer's end, killed in the middle of its second bucket. `receive_each(anns,
out)`: one engine worker's place, kept across the announcements it is given.
`engine_worker(source, worker_rank, out)`: receive as one of an engine's
workers does.
"""

from __future__ import annotations

import hashlib
import time

TIMEOUT_S = 15.0  # every wait of a `Root`'s epoch unless it is given another


def fingerprint(tensor) -> str:
    """A hash of a tensor's bytes (tensors themselves would be shared through memory the process frees)."""
    import torch

    return hashlib.sha1(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class Root:
    """The trainer's end: the run's store, one epoch, rank 0; `versions` filled into buckets of their own."""

    def __init__(self, epoch: int, world: int, w: dict, versions: dict[int, dict], host: str = "127.0.0.1",
                 port: int = 0, timeout_s: float = TIMEOUT_S):
        from rlbus.weights.broadcast import Layout, bucket_digest, serve_store

        self.host, self.timeout_s = host, timeout_s
        self.store, port = serve_store(host, port, timeout_s)
        self.layout = Layout.plan(list(w.items()), bucket_bytes=20_000)
        self.buckets = {}
        for version, tensors in versions.items():
            self.buckets[version] = self.layout.allocate()
            self.layout.fill(self.buckets[version], tensors)
        self.ann = {"epoch": epoch, "backend": "gloo", "address": f"{host}:{port}", "world": world,
                    "timeout_s": timeout_s,
                    "digests": {str(v): bucket_digest(b) for v, b in self.buckets.items()}}
        self.open(epoch, world)

    def open(self, epoch: int, world: int) -> None:
        from rlbus.weights.broadcast import epoch_store

        self.ann.update(epoch=epoch, world=world)
        self.kv, _ = epoch_store(self.ann["address"], epoch, self.timeout_s, store=self.store)
        self.kv.set("layout", self.layout.to_bytes())

    def comm(self):
        from rlbus.weights.broadcast import make_comm

        return make_comm("gloo", self.kv, 0, self.ann["world"], self.timeout_s, self.host)


def receive(ann: dict, rank: int, versions: list[int], out) -> None:
    from rlbus.weights.broadcast import BroadcastError, Member

    try:
        member = Member(dict(ann, rank=rank))
        for version in versions:
            started = time.monotonic()
            seconds = member.receive(version, ann["digests"][str(version)])
            out.put(("ok", rank, version, {n: fingerprint(t) for n, t in member.layout.views(member.buckets)},
                     seconds, time.monotonic() - started))
        member.close()
    except BroadcastError as exc:
        out.put(("failed", rank, None, str(exc), None, None))


def receive_then_die(ann: dict, rank: int, out) -> None:
    from rlbus.weights.broadcast import Member

    member = Member(dict(ann, rank=rank))
    member.comm.broadcast(member.buckets[0])
    out.put(("first_bucket", rank))
    time.sleep(600)


def big_weights() -> dict:
    """A 1 MB tensor and a 64 MB one: two buckets, each a broadcast of its own, the second long enough to be
    cut off in the middle."""
    import torch

    g = torch.Generator().manual_seed(7)
    return {"a": torch.randn(256, 1024, generator=g), "b": torch.randn(16 << 10, 1024, generator=g)}


def send_then_die(world: int, timeout_s: float, ann_out, out) -> None:
    """The trainer's end in a process of its own: open epoch 1 of `big_weights` for `world` ranks, put its
    announcement on `ann_out`, broadcast the first bucket, say so, and broadcast the second (until it is
    killed, which the test does as soon as it hears)."""
    tensors = big_weights()
    root = Root(1, world, tensors, {1: tensors}, timeout_s=timeout_s)
    ann_out.put(root.ann)
    comm = root.comm()
    comm.broadcast(root.buckets[1][0])
    out.put(("first_bucket", 0))
    comm.broadcast(root.buckets[1][1])
    time.sleep(600)


def receive_each(anns, out) -> None:
    """One engine worker (rank 1) receiving each announcement taken from `anns` (None ends it) through
    `receive_version`, which keeps the worker's place between them; ("ok", fingerprints) or ("failed", message)
    for each on `out`."""
    from rlbus.weights.broadcast import receive_version

    worker = Worker(0)
    while (ann := anns.get()) is not None:
        try:
            tensors = receive_version(worker, ann, 1, {})
            out.put(("ok", {n: fingerprint(t) for n, t in tensors}))
        except Exception as exc:  # reported to the test, which says what it expected
            out.put(("failed", f"{type(exc).__name__}: {exc}"))


class Worker:
    """What `rlbus.weights.sync.open_source` needs of a vLLM worker: its rank among the engine's workers."""

    def __init__(self, rank: int):
        self.rank = rank


def engine_worker(source: dict, worker_rank: int, out) -> None:
    """One worker of an explorer's engine, receiving as vLLM's workers do (`open_source` on the worker)."""
    from rlbus.weights.sync import open_source

    tensors, info = open_source(source, Worker(worker_rank))
    out.put((worker_rank, {n: fingerprint(t) for n, t in tensors}))


def victim_main(broker: str, bus: str, name: str, marker: str) -> None:
    """A broadcast-capable explorer peer without an engine: joins the first epoch naming it, receives one
    bucket, touches `marker`, then waits to be killed."""
    from pathlib import Path

    import torch.distributed  # noqa: F401

    from rlbus.common.client import BrokerClient
    from rlbus.weights.broadcast import Member

    # torch.distributed is loaded before HELLO, as in an explorer, whose engine has loaded torch: imported once
    # the epoch was announced, it took 3.5-4.6 s alone, and more in the suite, where once the victim missed
    # the epoch's 10 s rendezvous (and went silent for long enough that the broker dropped it meanwhile).
    client = BrokerClient(broker, "explorer", name, bus_address=bus, heartbeat_interval_s=0.2,
                          capabilities={"sync_methods": ["checkpoint", "nccl"], "broadcast_backends": ["gloo"]})
    client.start(10)
    while True:
        ann = (client.weights or {}).get("broadcast")
        if ann and name in ann["ranks"]:
            break
        time.sleep(0.02)
    member = Member(dict(ann, rank=ann["ranks"][name]))
    member.comm.broadcast(member.buckets[0])
    Path(marker).touch()
    time.sleep(600)


if __name__ == "__main__":
    import sys

    victim_main(*sys.argv[1:5])

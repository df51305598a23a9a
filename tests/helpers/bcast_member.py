"""A broadcast member in a plain process (no vLLM), for the broadcast tests and benchmark.

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


def fingerprint(tensor) -> str:
    """A hash of a tensor's bytes (tensors themselves would be shared through memory the process frees)."""
    import torch

    return hashlib.sha1(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


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
    """The trainer's end in a process of its own: serve the run's store, open epoch 1 for `world` ranks, put its
    announcement on `ann_out`, broadcast the first bucket of `big_weights`, say so, and broadcast the second
    (until it is killed, which the test does as soon as it hears)."""
    from rlbus.weights.broadcast import Layout, bucket_digest, epoch_store, make_comm, serve_store

    store, port = serve_store("127.0.0.1", 0, timeout_s)
    tensors = big_weights()
    layout = Layout.plan(list(tensors.items()), bucket_bytes=1 << 20)
    buckets = layout.allocate()
    layout.fill(buckets, tensors)
    kv, _ = epoch_store(f"127.0.0.1:{port}", 1, timeout_s, store=store)
    kv.set("layout", layout.to_bytes())
    ann_out.put({"epoch": 1, "backend": "gloo", "address": f"127.0.0.1:{port}", "world": world,
                 "timeout_s": timeout_s, "digests": {"1": bucket_digest(buckets)}})
    comm = make_comm("gloo", kv, 0, world, timeout_s, "127.0.0.1")
    comm.broadcast(buckets[0])
    out.put(("first_bucket", 0))
    comm.broadcast(buckets[1])
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

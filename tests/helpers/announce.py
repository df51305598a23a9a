"""A PUBLISH announcing a weight broadcast, for tests of the broker's checks on it."""

from __future__ import annotations

from rlbus.common import protocol as P


def broadcast_publish(world: int, ranks: dict, workers: dict | None = None) -> P.Message:
    broadcast = {"epoch": 1, "backend": "gloo", "address": "tcp://127.0.0.1:1", "world": world, "ranks": ranks,
                 "version": 1, "digest": "d", "timeout_s": 5.0, **({"workers": workers} if workers else {})}
    return P.Message(P.PUBLISH, {"version": 1, "method": "nccl", "location": "", "digest": "", "step": 1,
                                 "broadcast": broadcast})

"""The broker benchmark's trajectories, and what it times in its own process: one PUT header decoded and
validated, and the broker's storage path alone (no socket, no producer)."""

from __future__ import annotations

import time
from pathlib import Path

GROUP = 8  # samples per group (repeat)
BATCH_GROUPS = 64  # groups of one explorer batch (data.batch_tasks), as many as the consumer FETCHes a step


def make_batch(producer: int, first_group: int, groups: int, payload: bytes) -> list[tuple[dict, bytes]]:
    gids = {g: f"p{producer}-g{g}" for g in range(first_group, first_group + groups)}
    return [({"id": f"{gid}.{i}", "group_id": gid, "task_id": gid, "group_size": GROUP,
              "batch_index": g // BATCH_GROUPS, "policy_version": 0, "reward": float(i % 2), "n_tokens": 1024}, payload)
            for g, gid in gids.items() for i in range(GROUP)]


def sample_payload(large_kb: int = 0) -> bytes:
    import numpy as np

    if large_kb:  # opaque bytes: the broker never looks inside a payload
        return np.random.default_rng(0).bytes(large_kb << 10)

    from rlbus.common.trajectory import encode_payload

    rng = np.random.default_rng(0)
    return encode_payload({"prompt_ids": rng.integers(0, 49152, 128, dtype=np.int32),
                           "response_ids": rng.integers(0, 49152, 1024, dtype=np.int32),
                           "logprobs": -rng.random(1024, dtype=np.float32)},
                          {"finish_reason": "length", "reward": 1.0})


def decode_us(per_put: int, repeat: int) -> tuple[float, float]:
    """Microseconds to decode and validate one PUT header of the producers' (best of `repeat` rounds): the
    broker's path, and the general path alone (msgpack, the depth check, validation against the Struct)."""
    import timeit

    from rlbus.common import protocol as P

    items = make_batch(0, 0, per_put // GROUP, b"x")
    metas = [dict(m, info={"finish_reason": "stop"}) for m, _ in items]  # as explorers send them
    frames = P.encode(P.PUT, {"req": 1, "trajectories": metas}, [P.join_payloads(metas, [p for _, p in items])])

    def decode() -> None:
        P.validate(P.decode(frames))

    plain, out = P._plain_put, []
    for one_pass in (True, False):
        P._plain_put = plain if one_pass else (lambda header: None)
        try:
            out.append(min(timeit.repeat(decode, number=200, repeat=repeat)) / 200 * 1e6)
        finally:
            P._plain_put = plain
    return out[0], out[1]


def store_alone_mb_per_s(data_dir: Path, payload: bytes, per_put: int, puts: int, per_commit: int) -> float:
    """The broker's storage path alone, in this process, every PUT's frame already in memory (no socket, no
    producer): `Store.put` places, writes, syncs and catalogues `per_commit` PUTs a commit, as the writer does."""
    from rlbus.broker.store import Store

    n, frame, groups = len(payload), memoryview(payload * per_put), per_put // GROUP
    messages = [[(meta, frame[i * n:(i + 1) * n]) for i, (meta, _) in enumerate(make_batch(0, k * groups, groups, b""))]
                for k in range(puts)]
    store = Store(data_dir, "group")
    try:
        start = time.perf_counter()
        for first in range(0, puts, per_commit):
            store.put(messages[first:first + per_commit])
        return puts * per_put * n / (time.perf_counter() - start) / 1e6
    finally:
        store.close()

"""Weight sync by broadcast (`sync_method: nccl`), the sender: each version to the epoch's members.

For every published version, on the trainer's publishing thread:

1. Membership. STATUS lists the explorers the broker has; members are those
   that offer the run's broadcast backend, minus suspects (members that did
   not finish the last failed broadcast and have not caught up by checkpoint
   since). When the set changes, or the last epoch failed, a new epoch opens:
   its layout goes into the run's store under `e{E}/`.
2. Announce. PUBLISH `{version, method: nccl, location: "", broadcast:
   {epoch, backend, address, world, ranks, workers, version, digest,
   timeout_s}}`. Members see it on the bus between rollouts and join: an
   explorer whose engine has N workers (tensor parallel) takes ranks
   `ranks[name]` … `ranks[name] + N - 1`, one per worker, each of which
   receives the whole version and loads its own part of it.
3. Broadcast every bucket from rank 0, then wait for each member's
   `done/{version}/{rank}` key, one per worker (written after its digest check). Every wait
   is bounded by `sync.sync_timeout_s`, and cut short once the broker no
   longer lists a member (it drops one silent past its liveness: stopped, or
   its host gone); then, or on any error, the epoch is aborted (an `aborted`
   key in its store tells the members still waiting in it) and the next
   version opens a new one without the suspects.
4. Checkpoint. The same buckets are written as `weights/v{version}/` and
   PUBLISHed with their location: members that failed, explorers outside
   the group, late joiners and restarts load that.

With no member, a version is published as a checkpoint only.
"""

from __future__ import annotations

import datetime
import time
from concurrent.futures import CancelledError
from typing import Any

import structlog

from rlbus.common import protocol as P
from rlbus.common.client import BrokerError
from rlbus.common.config import RunConfig
from rlbus.weights.broadcast import Layout, bucket_digest, epoch_store, serve_store, unique_tensors
from rlbus.weights.comm import ALIVE_EVERY_S, BroadcastError, make_comm, resolve_backend, unavailable
from rlbus.weights.checkpoint import CheckpointSender

log = structlog.get_logger()


class BroadcastSender:
    method = "nccl"

    def __init__(self, cfg: RunConfig, checkpoint: CheckpointSender, dtype=None, device: str = "cpu"):
        s = cfg.sync
        self.checkpoint = checkpoint
        self.dtype = dtype
        self.backend = resolve_backend(s.broadcast_backend)
        reason = unavailable(self.backend)
        if reason:
            raise ValueError(f"sync.sync_method=nccl: {reason}")
        self.device = device if self.backend == "nccl" else "cpu"
        self.timeout_s = s.sync_timeout_s
        self.bucket_bytes = int(s.bucket_mb * (1 << 20))
        self.host = s.rendezvous_host
        self.store, port = serve_store(self.host, s.rendezvous_port, self.timeout_s)
        self.address = f"{self.host}:{port}"
        self.client = None
        self.layout: Layout | None = None
        self.names: dict[str, str] = {}  # state-dict name -> the name it is stored under (tied weights)
        self.epoch = 0
        self.members: tuple[tuple[str, int], ...] = ()  # (explorer, its engine's workers)
        self.comm = None
        self.suspects: dict[str, int] = {}  # member -> version it failed to receive
        log.info("broadcast_ready", backend=self.backend, address=self.address, timeout_s=self.timeout_s)

    def attach(self, client) -> None:
        self.client = client

    # ---- snapshot (training thread) ---------------------------------------

    def snapshot(self, model) -> tuple[Any, list]:
        state = model.state_dict()
        if self.layout is None:
            self._plan(state)
        buckets = self.layout.allocate(self.device)
        stored = dict(self.layout.views(buckets))
        # One tensor at a time into its place: a sharded trainer's state (trainer/distributed.py) is gathered
        # as it is read, so no second full copy is ever held beside the buckets.
        for name, t in state.items():
            if self.names[name] == name:
                stored[name].copy_(t)
        return model, buckets

    def _plan(self, state) -> None:
        import torch

        unique_meta = getattr(state, "unique_meta", None)  # a sharded state says it without gathering
        unique = unique_meta() if unique_meta else unique_tensors(state)
        dt = self.dtype
        self.layout = Layout.plan([(n, torch.empty(t.shape, dtype=dt or t.dtype, device="meta")) for n, t in unique],
                                  self.bucket_bytes)
        if unique_meta:
            first = {state.tie[n]: n for n, _ in unique}
            self.names = {n: first[state.tie[n]] for n in state.keys()}
        else:
            ptrs = {t.data_ptr(): n for n, t in unique}
            self.names = {n: ptrs[t.data_ptr()] for n, t in state.items()}

    # ---- publish (publishing thread) --------------------------------------

    def publish(self, snapshot: tuple[Any, list], version: int, step: int) -> dict[str, Any]:
        model, buckets = snapshot
        members = self._members()
        if members:
            self._broadcast(buckets, version, step, members)
        views = dict(self.layout.views(buckets))
        state = {name: views[stored] for name, stored in self.names.items()}
        result = self.checkpoint.publish((model, state), version, step)
        result["method"] = "nccl"
        return result

    def _members(self) -> tuple[tuple[str, int], ...]:
        status = self.client.request(P.STATUS, {}, timeout=self.timeout_s).header
        members = []
        for peer in status["peers"]:
            caps = peer.get("capabilities") or {}
            if peer["role"] != "explorer" or self.backend not in caps.get("broadcast_backends", []):
                continue
            failed_at = self.suspects.get(peer["name"])
            if failed_at is not None:
                if peer["policy_version"] < failed_at:
                    continue
                del self.suspects[peer["name"]]  # caught up by checkpoint: back in at the next epoch
            members.append((peer["name"], int(caps.get("broadcast_workers") or 1)))
        return tuple(sorted(members))

    def _open_epoch(self, members: tuple[tuple[str, int], ...]) -> None:
        self._close_comm()
        self.epoch += 1
        self.members = members
        store, _ = epoch_store(self.address, self.epoch, self.timeout_s, store=self.store)
        store.set("layout", self.layout.to_bytes())
        self.epoch_kv = store
        log.info("broadcast_epoch", epoch=self.epoch, members=[name for name, _ in members], world=_ranks(members)[1],
                 workers={name: n for name, n in members if n > 1})

    def _close_comm(self) -> None:
        if self.comm is not None:
            self.comm.close()
            self.comm = None

    def _broadcast(self, buckets: list, version: int, step: int, members: tuple[tuple[str, int], ...]) -> None:
        if members != self.members or self.comm is None:
            self._open_epoch(members)
        ranks, world = _ranks(members)
        workers = dict(members)
        digest = bucket_digest(buckets)
        announcement = {"epoch": self.epoch, "backend": self.backend, "address": self.address,
                        "world": world, "ranks": ranks, "workers": workers, "version": version, "digest": digest,
                        "timeout_s": self.timeout_s}
        done = {name: [f"done/{version}/{r}" for r in range(ranks[name], ranks[name] + workers[name])]
                for name in ranks}
        started = time.monotonic()
        self.client.request(P.PUBLISH, {"version": version, "method": "nccl", "location": "", "digest": "",
                                        "step": step, "broadcast": announcement}, timeout=self.timeout_s)
        try:
            alive = self._still_listed(list(ranks))
            if self.comm is None:  # the rendezvous on a connection of its own, as a member's (`Member`)
                rendezvous, _ = epoch_store(self.address, self.epoch, self.timeout_s)
                self.comm = make_comm(self.backend, rendezvous, 0, world, self.timeout_s, self.host, alive)
            joined = time.monotonic()
            for bucket in buckets:
                self.comm.broadcast(bucket, alive)
            sent = time.monotonic()
            self._wait_done([key for keys in done.values() for key in keys], started + self.timeout_s, alive)
        except (BroadcastError, RuntimeError) as exc:
            missing = [n for n, keys in done.items() if not self.epoch_kv.check(keys)]
            for name in missing:
                self.suspects[name] = version
            try:
                self.epoch_kv.set("aborted", b"1")  # members still waiting in it give up (`Member.alive`)
            except RuntimeError:  # this process's own store: not expected; they wait out their own timeout then
                pass
            self._close_comm()
            log.warning("broadcast_aborted", epoch=self.epoch, policy_version=version, error=str(exc)[:300],
                        unfinished=missing, seconds=round(time.monotonic() - started, 3))
            return
        log.info("broadcast_done", epoch=self.epoch, policy_version=version, members=len(members),
                 bytes=self.layout.nbytes, rendezvous_s=round(joined - started, 3),
                 send_s=round(sent - joined, 3), seconds=round(time.monotonic() - started, 3))

    def _still_listed(self, names: list[str]):
        """For the waits of a broadcast: a check that raises BroadcastError once the broker no longer lists one of
        the epoch's members. It drops a peer silent for `broker.liveness` heartbeats: one stopped, or on a host
        gone from the network, whose connections stay open and on which gloo would wait out the whole timeout.
        A broker that does not answer at once, or that started less than two liveness windows ago (within which
        its peers say HELLO to it again), tells nothing: the wait goes on."""
        grace = 2 * self.client.liveness * self.client.hb

        def alive() -> None:
            try:
                status = self.client.request(P.STATUS, {}, timeout=ALIVE_EVERY_S).header
            except (TimeoutError, BrokerError, CancelledError):  # no answer now (busy, restarting, stopping)
                return
            if status.get("uptime_s", grace) < grace:  # restarted just now: its members are still saying HELLO
                return
            listed = {peer["name"] for peer in status.get("peers", [])}
            gone = [name for name in names if name not in listed]
            if gone:
                raise BroadcastError(f"epoch {self.epoch}: the broker no longer lists {', '.join(gone)} "
                                     f"(stopped, or silent past its liveness)")
        return alive

    def _wait_done(self, keys: list[str], deadline: float, alive) -> None:
        """Wait for every member's done key until `deadline`, checking `alive` every ALIVE_EVERY_S."""
        while True:
            left = deadline - time.monotonic()
            try:
                self.epoch_kv.wait(keys, datetime.timedelta(seconds=max(0.1, min(ALIVE_EVERY_S, left))))
                return
            except RuntimeError:  # torch's DistStoreError: not all there yet
                if left <= ALIVE_EVERY_S:
                    raise
            alive()

    def close(self) -> None:
        self._close_comm()
        self.checkpoint.close()


def _ranks(members: tuple[tuple[str, int], ...]) -> tuple[dict[str, int], int]:
    """Each member's first rank (its engine's workers take consecutive ones after the trainer's 0), and the
    group's size."""
    ranks, world = {}, 1
    for name, workers in members:
        ranks[name] = world
        world += workers
    return ranks, world

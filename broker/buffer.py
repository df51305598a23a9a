"""The broker's buffer service: PUTs stored by group commit, credit, FETCH (held until ready) and COMMIT.

Consecutive PUTs are stored with one group commit before any of them is
ACKed, so the fsync cost is shared by everything that arrived while the
previous one ran. A FETCH that finds too few ready groups waits up to its
`wait_ms` and is answered as soon as a write completes enough of them.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
import zmq

from rlbus.broker.catalog import DISK_ERRORS, storage_error, unrecorded
from rlbus.broker.metrics import BufferStats
from rlbus.broker.peers import Peer, Peers
from rlbus.broker.store import Group, Store
from rlbus.broker.tasks import TaskQueue
from rlbus.broker.writer import Writer
from rlbus.common import protocol as P
from rlbus.common.config import RunConfig

log = structlog.get_logger()


class Outbox(Protocol):
    """What a service answers through: the broker's socket."""

    def reply(self, identity: bytes, msg: P.Message, command: str, header: dict[str, Any],
              payloads: list[bytes] | None = None) -> None: ...

    def send(self, identity: bytes, frames: list[bytes]) -> None: ...

    def bad(self, identity: bytes, exc: P.ProtocolError, body: list[bytes]) -> None: ...


@dataclass(slots=True)
class HeldFetch:
    identity: bytes
    msg: P.Message
    deadline: float
    expired: int = 0  # trajectories retired while it waited, reported in its EMPTY
    skipped: int = 0


class Buffer:
    def __init__(self, cfg: RunConfig, store: Store, tasks: TaskQueue, peers: Peers, out: Outbox,
                 ctx: zmq.Context):
        self.cfg = cfg
        self.store = store
        self.tasks = tasks
        self.peers = peers
        self.out = out
        self.hb = cfg.broker.heartbeat_interval_s  # a refusal for the disk names it as when to resend (`retry_after_s`)
        self.writer = Writer(store, ctx)
        self.trainer_step = int(store.get_meta("trainer_step", 0))
        self.held: list[HeldFetch] = []
        self.blocked: list[tuple[bytes, P.Message]] = []
        self.stats = BufferStats()  # PUT-to-ACK latency and delivered staleness, for /metrics

    def next_deadline(self) -> float | None:
        """When the first held FETCH runs out, if one is held."""
        return min((h.deadline for h in self.held), default=None)

    def credit(self) -> int:
        return max(0, self.cfg.buffer.capacity - self.store.depth)

    def store_puts(self, puts: list[tuple[bytes, P.Message]]) -> None:
        received = time.monotonic()
        limit = self.cfg.broker.max_payload_bytes
        batches: list[list[tuple[dict, bytes]]] = []
        accepted: list[tuple[bytes, P.Message, list[str]]] = []
        room = self.credit()
        known = self.store.ids
        adding: Counter[str] = Counter()  # samples the PUTs of this drain add to each group
        sizes: dict[str, int] = {}
        seen: set[str] = set()
        for identity, msg in puts:
            peer = self.peers.get(identity)
            if peer is None:
                self.out.reply(identity, msg, P.ERROR, {"code": "not_registered", "message": "say HELLO first"})
                continue
            if peer.role != "explorer":
                self.out.reply(identity, msg, P.ERROR, {
                    "code": "bad_role", "message": f"PUT is for explorers; this peer's role is {peer.role}"})
                continue
            metas = msg.header["trajectories"]
            too_big = next((m["id"] for m in metas if m["payload_bytes"] > limit), None)
            if too_big is not None:
                self.out.bad(identity, P.ProtocolError("too_large", f"payload of {too_big} exceeds {limit} bytes"),
                          [P.PROTOCOL, b"PUT", P.pack({"req": msg.header.get("req")})])
                continue
            ids = [m["id"] for m in metas]
            if not self.store.pending_ids.isdisjoint(ids):
                # A resend of ids still being written: answer once those are durable.
                self.blocked.append((identity, msg))
                continue
            fresh = len({i for i in ids if i not in known})
            if fresh > room:
                peer.starved = True
                self.out.reply(identity, msg, P.ACK, {"stored": [], "duplicate": [i for i in ids if i in known],
                                                   "deferred": [i for i in ids if i not in known],
                                                   "credit": 0, "depth": self.store.depth})
                continue
            why = self.store.refuse_join(metas, adding, sizes, seen)
            if why is not None:
                self.out.reply(identity, msg, P.ERROR, {"code": "conflict", "message": f"nothing stored: {why}"})
                continue
            room -= fresh
            for meta in metas:
                meta["explorer"] = peer.name
            batches.append(list(zip(metas, P.split_payloads(metas, msg.payloads[0]))))
            accepted.append((identity, msg, ids))
        if not batches:
            return
        job = self.store.prepare(batches)
        if job is None:  # every id is durable already
            return self._ack(accepted, [set()] * len(accepted), received)
        job.acks, job.received = accepted, received
        self.writer.submit(job)

    def _ack(self, accepted: list[tuple[bytes, P.Message, list[str]]], stored_by: list[set[str]],
             received: float) -> None:
        """ACK each PUT: `stored` lists the ids that PUT itself stored, every other id is a `duplicate`
        (stored before, or by another PUT of the same group commit)."""
        self.stats.put_ack.observe(time.monotonic() - received, len(accepted))
        credit = self.credit()
        for (identity, msg, ids), stored in zip(accepted, stored_by, strict=True):
            unique = list(dict.fromkeys(ids))
            self.out.reply(identity, msg, P.ACK, {"stored": [i for i in unique if i in stored],
                                               "duplicate": [i for i in unique if i not in stored],
                                               "deferred": [], "credit": credit, "depth": self.store.depth})

    def written(self) -> None:
        """Group commits the writer finished: ACK them, or refuse them if the disk failed."""
        any_completed = False
        for job, error in self.writer.completed():
            if error:
                self.store.abandon(job)
                for identity, msg, _ in job.acks:
                    self.out.reply(identity, msg, P.ERROR, storage_error(f"not stored, resend later: {error}", self.hb))
                continue
            completed = self.store.finish(job)
            for group in completed:
                self.tasks.complete(group.group_id, informative=not group.zero_spread)
            any_completed |= bool(completed)
            self._ack(job.acks, job.stored_by, job.received)
        if self.blocked:
            blocked, self.blocked = self.blocked, []
            self.store_puts(blocked)
        if self.held and any_completed:
            self.serve_held()

    def fetch(self, peer: Peer, msg: P.Message) -> None:
        h = msg.header
        step = h["step"]
        if step <= self.store.committed_step and self.store.delivered(step) is None:
            return self.out.reply(peer.identity, msg, P.ERROR, {
                "code": "conflict", "message": f"step {step} was committed already (last committed: "
                                               f"{self.store.committed_step}); fetch a later step"})
        newest = max(self.trainer_step, self.store.committed_step)
        if peer.fetched and step > newest + 1:  # a trainer's first FETCH says where it (re)starts
            return self.out.reply(peer.identity, msg, P.ERROR, {
                "code": "conflict", "message": f"step {step} skips steps: the trainer's last step here is "
                                               f"{newest}; steps advance one at a time"})
        peer.fetched = True
        if step > self.trainer_step:
            self.trainer_step = step  # made durable with the batch delivered for it
        retired = self._try_fetch(peer.identity, msg)
        if retired is not None:
            wait_ms = h.get("wait_ms", 0)
            if wait_ms > 0 and not self.drained:  # drained: nothing it could wait for will come
                self.held.append(HeldFetch(peer.identity, msg, time.time() + wait_ms / 1000, *retired))
            else:
                self.empty(peer.identity, msg, *retired)

    def _try_fetch(self, identity: bytes, msg: P.Message) -> tuple[int, int] | None:
        """Deliver the batch of the FETCH's step if it can be made; else (expired, skipped) retired now.

        A step has one batch: once delivered (and until committed) every FETCH of
        that step gets the same groups again, whether it was held or not.
        """
        h = msg.header
        step, batch_index = h["step"], h.get("batch_index")
        again = self.store.delivered(step)
        if again is not None:
            log.info("batch_redelivered", step=step, groups=len(again))
            # the same batch in every respect: a trainer that scales its loss by skipped samples trains the same
            self._send_batch(identity, msg, step, again, *self.store.retired_with.get(step, (0, 0)))
            return None
        if batch_index is not None and not self.tasks.batch_resolved(batch_index):
            return 0, 0
        if batch_index is not None and self.tasks.past_end(batch_index) and self.drained:
            return 0, 0  # a batch past the taskset's end: EMPTY `exhausted`
        groups, expired, skipped = self.store.select(step, h["max_groups"], self.cfg.sync.max_staleness,
                                                     batch_index, h.get("skip_zero_spread", False))
        if expired or skipped:
            log.info("groups_retired", step=step, expired=expired, skipped=skipped)
            self.refill()
        # Once nothing more can come, whatever is left makes the batch, however few its groups.
        enough = len(groups) >= h.get("min_groups", 1) or batch_index is not None or (groups and self.drained)
        if not enough:
            return expired, skipped
        self.store.deliver(step, groups, {"trainer_step": self.trainer_step}, expired, skipped)
        log.info("batch_delivered", step=step, groups=len(groups), depth=self.store.depth)
        self._send_batch(identity, msg, step, groups, expired, skipped)
        return None

    def _send_batch(self, identity: bytes, msg: P.Message, step: int, groups: list[Group],
                    expired: int, skipped: int) -> None:
        out = [{"group_id": g.group_id, "batch_index": g.batch_index, "trajectories": [t.meta for t in g.trajs]}
               for g in groups]
        self.stats.delivered(step, groups)
        frames = self.store.payload_frames([t for g in groups for t in g.trajs])
        self.out.reply(identity, msg, P.BATCH, {"step": step, "groups": out, "expired": expired, "skipped": skipped},
                    frames)

    @property
    def drained(self) -> bool:
        """No group will come any more: the taskset is exhausted, no task is leased, no PUT is being stored."""
        return self.tasks.exhausted and not self.tasks.leases and not self.store.pending_ids and not self.blocked

    def empty(self, identity: bytes, msg: P.Message, expired: int, skipped: int) -> None:
        reason = "exhausted" if self.drained else "not_enough_ready_groups"
        self.out.reply(identity, msg, P.EMPTY, {"step": msg.header["step"], "reason": reason,
                                             "depth": self.store.depth, "expired": expired, "skipped": skipped})

    def serve_held(self) -> None:
        still = []
        for held in self.held:
            if held.identity not in self.peers:
                continue
            try:
                retired = self._try_fetch(held.identity, held.msg)
            except DISK_ERRORS as exc:  # its batch could not be recorded: nothing was delivered
                self.out.reply(held.identity, held.msg, P.ERROR, storage_error(unrecorded(exc), self.hb))
                continue
            if retired is not None:
                held.expired += retired[0]
                held.skipped += retired[1]
                still.append(held)
        self.held = still

    def commit(self, peer: Peer, msg: P.Message) -> None:
        step = msg.header["step"]
        if step not in self.store.batches and not self.store.was_delivered(step):
            return self.out.reply(peer.identity, msg, P.ERROR, {
                "code": "conflict", "message": f"no batch was delivered for step {step}"})
        n = self.store.commit(step)
        log.info("batch_committed", step=step, trajectories=n, depth=self.store.depth)
        self.out.reply(peer.identity, msg, P.OK, {})
        self.refill()

    def refill(self) -> None:
        """Tell producers that were given zero credit that there is room again."""
        credit = self.credit()
        if credit <= 0:
            return
        for peer in self.peers:
            if peer.starved:
                peer.starved = False
                self.out.send(peer.identity, P.encode(P.CREDIT, {"credit": credit}))

    def expire_held(self, now: float) -> None:
        """Answer held FETCHes whose wait ran out with EMPTY."""
        for held in [h for h in self.held if h.deadline <= now]:
            self.held.remove(held)
            if held.identity in self.peers:
                self.empty(held.identity, held.msg, held.expired, held.skipped)

    def close(self) -> None:
        self.writer.stop()
        self.written()
        self.writer.done.close(0)

"""The broker: one ROUTER for requests, one PUB for the weight-version bus.

A single thread runs the loop: receive what is waiting, answer it, then do
the periodic work (heartbeats, peer expiry, lease expiry, republishing the
weight state, timing out held FETCHes). This module is the shell: sockets,
the dispatch table (command -> handler and the roles that may send it),
peers and timers. The services do the rest: the buffer (`buffer.py`: PUT,
credit, FETCH, COMMIT), tasks and admission (`tasks.py`), the weight bus
(`bus.py`) and reward routing (`rewards.py`).

A message that does not follow docs/protocol.md gets an ERROR reply and a log
line; nothing a peer sends can stop the loop or lose acknowledged data.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable

import structlog
import zmq

from rlbus.broker import endpoints
from rlbus.broker.bus import WeightBus
from rlbus.broker.peers import Peer, Peers
from rlbus.broker.rewards import RewardRouter
from rlbus.broker.buffer import Buffer
from rlbus.broker.catalog import DISK_ERRORS, storage_error, unrecorded
from rlbus.broker.rollout import RunRollout
from rlbus.broker.store import Store
from rlbus.broker.swaps import SwapSlots
from rlbus.broker.tasks import TaskQueue, refusal
from rlbus.common import protocol as P
from rlbus.common.config import RunConfig
from rlbus.common.processes import Waker
from rlbus.common.tasksets import make_taskset

log = structlog.get_logger()

_WHO = {"explorer": "explorers", "trainer": "the trainer", "reward": "reward workers"}

PUT_DRAIN = 256  # messages taken off the socket before one group commit
# Handlers that write the catalogue before they change anything: a disk that fails them (full, read-only) leaves
# nothing changed, answered `storage_error`, which clients resend later. PUT answers its own disk errors.
RECORDED_FIRST = frozenset({P.HELLO, P.LEASE, P.FETCH, P.COMMIT, P.PUBLISH})


class Broker:
    def __init__(self, cfg: RunConfig, ctx: zmq.Context | None = None):
        self.cfg = cfg
        self.ctx = ctx or zmq.Context.instance()
        bcfg = cfg.broker
        self.hb = bcfg.heartbeat_interval_s
        self.expiry = bcfg.liveness * self.hb
        self.store = Store(cfg.buffer_dir(), cfg.buffer.fsync, cfg.buffer.segment_bytes, cfg.buffer.cache_mb << 20)
        self.run_id = self.store.get_meta("run_id") or f"{cfg.run.name}-{uuid.uuid4().hex[:8]}"
        self.store.set_meta("run_id", self.run_id)
        self.started_at = self.store.get_meta("started_at") or time.time()
        self.store.set_meta("started_at", self.started_at)
        self.peers = Peers()
        self.rollout = RunRollout(cfg, self.store.catalog)
        self.explorers_seen: set[str] = set()  # names of the explorers that ever joined (trainer.wait_for_explorers)
        self.started = time.monotonic()
        self.tasks = TaskQueue(self.store.catalog, make_taskset(cfg.data), cfg.data.batch_tasks,
                               bcfg.lease_timeout_s, cfg.data.revisit, cfg.data.revisit_times)
        self.buffer = Buffer(cfg, self.store, self.tasks, self.peers, self, self.ctx)
        self.rewards = RewardRouter(self.peers, self.send, cfg.reward.eval_timeout_s, cfg.reward.eval_attempts)
        self.swaps = SwapSlots(cfg.sync.max_swapping, cfg.sync.swap_timeout_s)
        try:
            self.sockets = endpoints.open_sockets(self.ctx, bcfg)
        except endpoints.BindError:
            self.buffer.close()
            self.store.close()
            raise
        s = self.sockets
        self.router, self.pub, self.port, self.pub_port = s.router, s.pub, s.port, s.pub_port
        self.bus = WeightBus(self.pub, self.store, bcfg.republish_interval_s)
        anyone = tuple(sorted(P.ROLES))
        self.handlers: dict[str, tuple[Callable[[Peer, P.Message], None], tuple[str, ...]]] = {
            P.HEARTBEAT: (self._heartbeat, anyone),
            P.STATUS: (lambda p, m: self.reply(p.identity, m, P.STATUS, self.status()), anyone),
            P.BYE: (self._bye, anyone), P.LEASE: (self._lease, ("explorer",)),
            P.FETCH: (self.buffer.fetch, ("trainer",)), P.COMMIT: (self.buffer.commit, ("trainer",)),
            P.PUBLISH: (self._publish, ("trainer",)), P.SWAP: (self._swap, ("explorer",)),
            P.EVAL: (lambda p, m: self.rewards.submit(p.identity, m), anyone),
            P.RESULT: (self.rewards.result, ("reward",)),
        }
        self._last_tick, self._running = 0.0, True
        self._waker = Waker()  # `stop` ends the loop's poll at once: a stop signal is not kept waiting for it

    # ---- loop -------------------------------------------------------------

    def serve(self, stop_after: float | None = None) -> None:
        endpoints.write(self.cfg.buffer_dir(), self.cfg.broker.host, self.port, self.pub_port)
        log.info("broker_ready", run_id=self.run_id, port=self.port, pub_port=self.pub_port,
                 depth=self.store.depth, trainer_step=self.buffer.trainer_step,
                 weights_version=self.bus.state["version"], curve=self.sockets.auth is not None)
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.buffer.writer.done, zmq.POLLIN)
        poller.register(self._waker.fileno, zmq.POLLIN)
        end = None if stop_after is None else time.monotonic() + stop_after
        self.peers.turn(time.time(), self.hb)  # the listening clock starts: a stall before the first tick counts
        # Holders of leases granted before a restart have two liveness windows of listening to say HELLO.
        self._claim_by = self.peers.clock(time.time()) + 2 * self.expiry
        while self._running and (end is None or time.monotonic() < end):
            events = dict(poller.poll(self._poll_timeout_ms()))
            if self.buffer.writer.done in events:
                self.buffer.written()
            if self.router in events:
                self._drain()
            self._tick()
        self.close()

    def stop(self) -> None:
        self._running = False
        self._waker.wake()

    def _poll_timeout_ms(self) -> int:
        held = self.buffer.next_deadline()
        return int(1000 * (self.hb / 2 if held is None else min(self.hb / 2, max(0.0, held - time.time()))))

    def _drain(self) -> None:
        puts: list[tuple[bytes, P.Message]] = []
        for _ in range(PUT_DRAIN):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            identity, body = frames[0].bytes, P.received(frames[1:])  # payloads stay in ZeroMQ's buffers
            try:
                msg = P.decode(body, self.cfg.broker.max_message_bytes)
                P.validate(msg)
            except P.ProtocolError as exc:
                self.bad(identity, exc, body)
                continue
            peer = self.peers.get(identity)
            if peer is not None:
                self.peers.heard(peer, time.time())
            if msg.command == P.PUT:
                puts.append((identity, msg))
                continue
            if puts:
                self._guarded(self.buffer.store_puts, puts)
                puts = []
            self._guarded(self._dispatch, identity, msg)
        if puts:
            self._guarded(self.buffer.store_puts, puts)

    def _guarded(self, handler, *args) -> None:
        """Run one handler; a bug it hits is logged with its traceback and answered `ERROR internal`.

        The loop goes on serving everyone else. Handlers change state only after their checks pass, so what was
        acknowledged before stays as it was; a disk error in one of RECORDED_FIRST changed nothing: `storage_error`.
        """
        try:
            handler(*args)
        except Exception as exc:
            requests = args[0] if handler == self.buffer.store_puts else [args]
            command = requests[0][1].command if requests else None
            if isinstance(exc, DISK_ERRORS) and command in RECORDED_FIRST:
                log.warning("storage_failed", command=command, error=P.brief(exc))
                error = storage_error(unrecorded(exc), self.hb)
            else:
                log.exception("request_failed", command=command, error=P.brief(exc))
                error = {"code": "internal", "message": f"the broker failed on this request: {type(exc).__name__}; "
                                                        "see its log"}
            for identity, msg in requests:
                self.reply(identity, msg, P.ERROR, dict(error))

    def bad(self, identity: bytes, exc: P.ProtocolError, body: list[bytes]) -> None:
        peer = self.peers.get(identity)
        log.warning("bad_message", code=exc.code, reason=exc.message, peer=peer.name if peer else None,
                    frames=len(body))
        # `req` echoed whenever the header can be read (a header over the limit, or of another protocol version,
        # too), so the request is answered
        req = P.request_id(body[2]) if len(body) >= 3 else None
        self.send(identity, P.error(exc.code, exc.message, req))

    def send(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            # Large frames go without a copy: ZeroMQ holds a reference until sent.
            self.router.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # peer gone: nothing to deliver to
            log.debug("send_failed", error=str(exc))
            return
        peer = self.peers.get(identity)
        if peer is not None:
            peer.last_sent = time.time()

    def reply(self, identity: bytes, msg: P.Message, command: str, header: dict[str, Any],
               payloads: list[bytes] | None = None) -> None:
        if command == P.ERROR:  # every refusal is logged (docs/protocol.md, Errors)
            peer = self.peers.get(identity)
            log.warning("request_refused", command=msg.command, code=header["code"], reason=header["message"],
                        peer=peer.name if peer else None)
        if "req" in msg.header:
            header["req"] = msg.header["req"]
        self.send(identity, P.encode(command, header, payloads))

    def _dispatch(self, identity: bytes, msg: P.Message) -> None:
        if msg.command == P.HELLO:
            return self._hello(identity, msg)
        peer = self.peers.get(identity)
        if peer is None:
            if msg.command == P.BYE:
                return None
            return self.reply(identity, msg, P.ERROR, {
                "code": "not_registered", "message": "say HELLO first (the broker may have restarted)"})
        handler, roles = self.handlers[msg.command]
        if peer.role not in roles:
            return self.reply(identity, msg, P.ERROR, {
                "code": "bad_role", "message": f"{msg.command} is for {_WHO[roles[0]] if len(roles) == 1 else roles}; "
                                               f"this peer's role is {peer.role}"})
        handler(peer, msg)

    # ---- peers ------------------------------------------------------------

    def _hello(self, identity: bytes, msg: P.Message) -> None:
        h = msg.header
        now = time.time()
        if h["role"] == "trainer":
            other = self.peers.other_trainer(h["name"])
            if other is not None:
                return self.reply(identity, msg, P.ERROR, {
                    "code": "conflict", "message": f"trainer {other.name!r} is already connected; one trainer per run"})
        holder = self.peers.holder(h, identity)
        if holder is not None:
            wait = max(0.0, self.expiry - self.peers.silence(holder, now))
            return self.reply(identity, msg, P.ERROR, {
                "code": "conflict", "retry_after_s": round(wait + self.hb, 3),
                "message": f"name {h['name']!r} belongs to a live {holder.role} (last heard "
                           f"{now - holder.last_seen:.1f} s ago); pick another name, or retry once it has "
                           f"left or expired (in {wait:.1f} s)"})
        refusal = self.rollout.refusal(h.get("rollout", {}))
        if refusal:  # it would sample, or train, otherwise than the trainer's importance weights assume
            return self.reply(identity, msg, P.ERROR, {"code": "conflict", "message": refusal})
        if h["role"] != "tool":  # a tool that sends one only asks whether such a peer would be admitted
            self.rollout.admit(h.get("rollout", {}), h["name"])  # before any change: it may be refused for the disk
        if h["role"] == "trainer":
            self.bus.finish(False)  # a trainer back on a finished run: it goes on (recorded before any change too)
        previous = self.peers.get(identity)
        if previous is not None and previous.name != h["name"]:
            self._drop(previous, "renamed")  # one connection, one name: the old one's leases go back
        peer, reconnect = self.peers.join(identity, h, now)
        released, restored = self.tasks.claim(peer.name, h.get("session"), now)
        if released:  # another process under the name since a restart: it cannot know them
            log.info("leases_released", peer=peer.name, n=len(released), reason="another session")
        if peer.role == "explorer" and len(self.explorers_seen) < self.cfg.trainer.wait_for_explorers:
            self.explorers_seen.add(peer.name)  # bounded: only the count up to the wait matters
        log.info("peer_joined", peer=peer.name, role=peer.role, policy_version=peer.policy_version,
                 reconnect=reconnect, peers=len(self.peers), leases_restored=len(restored))
        s = self.cfg.sync
        self.reply(identity, msg, P.WELCOME, {
            "run_id": self.run_id, "started_at": self.started_at, "peer": peer.name, "heartbeat_interval_s": self.hb,
            "liveness": self.cfg.broker.liveness, "weights": self.bus.state, "credit": self.buffer.credit(),
            "max_message_bytes": self.cfg.broker.max_message_bytes, "rollout": self.rollout.settings,
            "sync": {"sync_style": s.sync_style, "sync_interval": s.sync_interval, "sync_offset": s.sync_offset,
                     "max_staleness": s.max_staleness, "sync_method": s.sync_method, "max_swapping": s.max_swapping,
                     "batch_tasks": self.cfg.data.batch_tasks, "repeat": self.cfg.rollout.repeat}})

    def _heartbeat(self, peer: Peer, msg: P.Message) -> None:
        if "policy_version" in msg.header:
            peer.policy_version = msg.header["policy_version"]

    def _bye(self, peer: Peer, msg: P.Message) -> None:
        self._drop(peer, "bye")
        if peer.role == "trainer" and msg.header.get("finished"):  # its last step taken: the run is over
            self.bus.finish(True)

    def _drop(self, peer: Peer, reason: str) -> None:
        self.peers.remove(peer)
        if peer.role == "reward":
            self.rewards.worker_gone(peer)
        self.rewards.client_gone(peer)
        released = self.tasks.release_holder(peer.name, keep=reason == "expired")  # silent: it may come back
        self.swaps.end(peer.name, time.time(), reason)
        log.info("peer_left", peer=peer.name, role=peer.role, reason=reason, leases_released=len(released),
                 peers=len(self.peers))

    # ---- tasks ------------------------------------------------------------

    def refusal(self, batch_index: int, version: int) -> tuple[str, int] | None:
        """Admission control for an explorer holding `version` (see rlbus.broker.tasks.refusal)."""
        queued = (sum(len(g.trajs) for g in self.store.ready.values()) // max(1, self.cfg.rollout.repeat)
                  + len(self.tasks.leases)) // self.cfg.data.batch_tasks
        step = self.buffer.trainer_step
        taken = step in self.store.batches or step <= self.store.committed_step
        return refusal(self.cfg.sync, batch_index, version, step, queued, step + 1 if taken else step)

    def _tasks(self, peer: Peer, msg: P.Message, granted: list) -> None:
        tasks = [{"lease_id": lz.lease_id, "task_id": t["task_id"], "seq": lz.seq,
                  "batch_index": self.tasks.batch_of(lz.seq), "task": t} for lz, t in granted]
        self.reply(peer.identity, msg, P.TASKS, {"tasks": tasks, "lease_s": self.cfg.broker.lease_timeout_s})

    def _lease(self, peer: Peer, msg: P.Message) -> None:
        version = msg.header["policy_version"]
        peer.policy_version = version
        if self.bus.finished:
            return self.reply(peer.identity, msg, P.DONE, {"reason": "finished"})
        req = msg.header.get("req")
        again = self.tasks.granted(peer.name, req, peer.joined)
        if again:  # a resend of a LEASE already granted (its TASKS lost with a connection): the same tasks again
            log.info("lease_resent", peer=peer.name, n=len(again), req=req)
            return self._tasks(peer, msg, again)
        now = time.time()
        room = self.cfg.buffer.capacity - self.store.depth - len(self.tasks.leases) * self.cfg.rollout.repeat
        if room < self.cfg.rollout.repeat:
            return self.reply(peer.identity, msg, P.WAIT, {"reason": "buffer_full", "retry_after_s": self.hb})
        if self.awaiting_explorers():  # a fresh run starts its explorers together
            return self.reply(peer.identity, msg, P.WAIT, {"reason": "explorers", "retry_after_s": self.hb})
        max_tasks = min(msg.header["max_tasks"], max(1, room // self.cfg.rollout.repeat))
        granted = self.tasks.lease(peer.name, max_tasks, now, lambda e: self.refusal(e, version) is None, req,
                                   peer.info["session"])  # recorded first: a disk error leases nothing
        if granted:
            log.info("tasks_leased", peer=peer.name, n=len(granted), batch_index=self.tasks.batch_of(granted[0][0].seq),
                     policy_version=version, depth=self.store.depth)
            return self._tasks(peer, msg, granted)
        batch = self.tasks.next_batch()
        if batch is None:
            if self.tasks.leases:
                return self.reply(peer.identity, msg, P.WAIT, {"reason": "leased", "retry_after_s": self.hb})
            return self.reply(peer.identity, msg, P.DONE, {"reason": "taskset"})
        reason, need = self.refusal(batch, version) or ("ahead", 0)
        log.info("lease_wait", peer=peer.name, policy_version=version, reason=reason, need_version=need,
                 batch_index=batch, trainer_step=self.buffer.trainer_step)
        header = {"reason": reason, "retry_after_s": self.hb / 4 if reason == "ahead" else self.hb}
        if reason == "version":
            header["need_version"] = need
        self.reply(peer.identity, msg, P.WAIT, header)

    def _swap(self, peer: Peer, msg: P.Message) -> None:
        self.reply(peer.identity, msg, *self.swaps.answer(peer.name, msg.header, time.time(), self.hb / 4))

    def _publish(self, peer: Peer, msg: P.Message) -> None:
        error = self.bus.publish(msg.header)
        answer = (P.OK, {}) if error is None else (P.ERROR, {"code": error.code, "message": error.message})
        self.reply(peer.identity, msg, *answer)

    def awaiting_explorers(self) -> bool:
        """A fresh run hands out no task until `trainer.wait_for_explorers` explorers have joined or
        `trainer.wait_for_explorers_s` has passed since the broker started (STATUS `explorers_awaited`)."""
        t = self.cfg.trainer
        return (self.buffer.trainer_step == 0 and len(self.explorers_seen) < t.wait_for_explorers
                and time.monotonic() - self.started < t.wait_for_explorers_s)

    def status(self) -> dict[str, Any]:
        now = time.time()
        c = self.store.counts
        return {
            "run_id": self.run_id, "uptime_s": round(time.monotonic() - self.started, 3), "weights": self.bus.state,
            "trainer_step": self.buffer.trainer_step,
            "peers": [{"name": p.name, "role": p.role, "policy_version": p.policy_version,
                       "last_seen_s": round(now - p.last_seen, 3), "leases": self.tasks.held_by(p.name),
                       "capabilities": p.info.get("capabilities", {})}
                      for p in self.peers],
            "buffer": {"depth": self.store.depth, "capacity": self.cfg.buffer.capacity,
                       "ready_groups": len(self.store.ready), "stored": c["stored"], "committed": c["committed"],
                       "expired": c["expired"], "skipped": c["skipped"]},
            "tasks": {"issued": self.tasks.next_seq, "leased": len(self.tasks.leases), "done": len(self.tasks.done),
                      "revisits": len(self.tasks.waiting)},
            "swapping": sorted(self.swaps.holders),
            "explorers_awaited": {"expected": self.cfg.trainer.wait_for_explorers,
                                  "joined": sorted(self.explorers_seen), "waiting": self.awaiting_explorers()},
        }

    # ---- periodic ---------------------------------------------------------

    def _tick(self) -> None:
        now = time.time()
        stalled = self.peers.turn(now, self.hb)  # a turn is one poll (hb / 2) and its work: beyond hb, not reading
        if stalled:
            log.warning("broker_stalled", seconds=round(stalled, 2), note="not counted against its peers' liveness")
        self.buffer.expire_held(now)
        if now - self._last_tick < self.hb / 2:
            return
        self._last_tick = now
        for peer in self.peers.silent(now, self.expiry):
            self._drop(peer, "expired")
        for peer in self.peers:
            if now - peer.last_sent >= self.hb:
                self.send(peer.identity, P.encode(P.HEARTBEAT, {"credit": self.buffer.credit()}))
        self.rewards.tick(now)
        self.swaps.expire(now)
        expired = self.tasks.expire(now)
        if self.tasks.unclaimed and self.peers.clock(now) > self._claim_by:  # granted before a restart to the gone
            expired += self.tasks.release_unclaimed()
        if expired:
            log.info("leases_expired", n=len(expired), seqs=[lz.seq for lz in expired][:16])
        self.bus.tick(now)

    def close(self) -> None:
        log.info("broker_stopping", depth=self.store.depth, peers=len(self.peers))
        self.buffer.close()
        self.sockets.close()
        self.store.close()
        self._waker.close()

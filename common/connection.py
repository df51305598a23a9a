"""The broker client's I/O thread: the sockets, the outbox, replies, reconnects and heartbeats.

`BrokerClient` (client.py) is the API callers use from any thread; this is
the part that runs only on the client's own thread, which owns the DEALER
socket (ZeroMQ sockets are not thread-safe) and the bus's SUB socket.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq

from rlbus.common import protocol as P
from rlbus.common.curve import use_keys

log = structlog.get_logger()


class BrokerError(Exception):
    """The broker answered ERROR."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class BrokerUnreachable(ConnectionError):
    """The broker went silent while this peer was stopping: what waited for it will not be answered."""


class NoWelcome(TimeoutError):
    """No WELCOME within a client's start timeout: no broker answers at its address."""


class StoppedBeforeWelcome(Exception):
    """A stop signal reached the process while its client waited for the broker's WELCOME."""


@dataclass(eq=False)
class _Request:
    command: str
    header: dict[str, Any]
    payloads: list[bytes]
    future: Future = field(default_factory=Future)
    req: int = 0
    submitted: float = field(default_factory=time.monotonic)
    # PUT bookkeeping: results gathered across ACKs and deferrals.
    stored: list[str] = field(default_factory=list)
    duplicate: list[str] = field(default_factory=list)
    refusals: int = 0  # `storage_error`s: the broker could not write what this request needed

    @property
    def size(self) -> int:
        return len(self.header["trajectories"]) if self.command == P.PUT else 0


class Connection:
    """The I/O thread's half of `BrokerClient`; the attributes it uses are set in `BrokerClient.__init__`."""

    def _open(self) -> None:
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        if self.curve:
            use_keys(self.sock, *self.curve)
        P.allow_ipv6(self.sock, self.address)
        self.sock.connect(self.address)
        self._last_recv = time.monotonic()
        self._rehello()

    def _open_bus(self) -> None:
        self.sub = None
        if self.bus_address:
            self.sub = self.ctx.socket(zmq.SUB)
            self.sub.setsockopt(zmq.LINGER, 0)
            if self.curve:
                use_keys(self.sub, *self.curve)
            self.sub.setsockopt(zmq.SUBSCRIBE, P.TOPIC_WEIGHTS)
            P.allow_ipv6(self.sub, self.bus_address)
            self.sub.connect(self.bus_address)

    def _send(self, command: str, header: dict[str, Any], payloads: list[bytes] | None = None) -> None:
        self.sock.send_multipart(P.encode(command, header, payloads), copy=False)
        self._last_send = time.monotonic()

    def _run(self) -> None:
        self._pending: dict[int, _Request] = {}
        self._held: deque[_Request] = deque()
        self._later: list[tuple[float, _Request]] = []  # requests the broker could not store, when to resend each
        self._welcome_ok = False
        self._backoff = self.backoff_initial
        self._last_send = 0.0
        self.sock = self.sub = None
        try:
            self._open()
            self._open_bus()
            while not self._stop.is_set():
                poller = zmq.Poller()
                poller.register(self.sock, zmq.POLLIN)
                poller.register(self._wake_rx, zmq.POLLIN)
                if self.sub is not None:
                    poller.register(self.sub, zmq.POLLIN)
                events = dict(poller.poll(int(self.hb * 250)))
                if self._wake_rx in events:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                    self._take_outbox()
                if self.sock in events:
                    while self.sock.poll(0):
                        # A BATCH's trajectories stay in ZeroMQ's buffers, as views, for as long as the reply.
                        self._on_message(P.received(self.sock.recv_multipart(copy=False)))
                if self.sub is not None and self.sub in events:
                    while self.sub.poll(0):
                        self._on_bus(self.sub.recv_multipart())
                self._timers()
        except Exception as exc:  # a bug here must not leave callers waiting forever, nor `start` for a WELCOME
            log.exception("client_thread_failed", peer=self.name)
            self._stop.set()
            error = RuntimeError(f"broker client thread failed ({type(exc).__name__}: {exc}); see the log")
            self._fail_all(error)
            if not self._welcomed.is_set():
                self._hello_error = error
                self._welcomed.set()
        finally:
            for sock in (self.sock, self.sub):
                if sock is not None:
                    sock.close(0)

    def _take_outbox(self) -> None:
        with self._lock:
            batch = list(self._outbox)
            self._outbox.clear()
        for request in batch:
            if request.future.cancelled():
                continue
            if request.command == P.BYE:
                # Nothing will answer what is still outstanding: say so rather than leave callers waiting.
                self._fail_outstanding(ConnectionError("the client said BYE before a reply came"))
                if self._welcome_ok:
                    self._send(P.BYE, request.header)
                self._bye_sent.set()
                continue
            if request.header.pop("_oneway", False):
                if self._welcome_ok:
                    self._send(request.command, request.header, request.payloads)
                request.future.set_result(None)
                continue
            request.req = next(self._ids)
            request.header["req"] = request.req
            self._held.append(request)
        self._flush()

    def _flush(self) -> None:
        """Send held requests in order while connected and credit allows."""
        if not self._welcome_ok:
            return
        while self._held:
            request = self._held[0]
            if request.future.cancelled():
                self._held.popleft()
                continue
            if request.command == P.PUT:
                in_flight = sum(1 for r in self._pending.values() if r.command == P.PUT)
                # Always allow one PUT in flight so a PUT larger than the whole credit still moves.
                if in_flight >= self.max_in_flight or (in_flight and request.size > self.credit):
                    return
                if self.credit <= 0 and in_flight:
                    return
                self.credit -= request.size
            self._held.popleft()
            self._pending[request.req] = request
            self._send(request.command, request.header, request.payloads)

    def _on_message(self, frames: list[bytes | memoryview]) -> None:
        self._last_recv = time.monotonic()
        try:
            msg = P.decode_reply(frames)
        except P.ProtocolError as exc:
            log.warning("bad_message_from_broker", code=exc.code, reason=exc.message)
            return
        h = msg.header
        if msg.command == P.WELCOME:
            if h.get("req", self._hello_req) != self._hello_req:
                return None  # to a HELLO sent before the current one: its WELCOME resends what waits
            return self._on_welcome(h)
        if msg.command in P.UNSOLICITED:
            self.inbox.put(msg)
            return None
        if msg.command in (P.HEARTBEAT, P.CREDIT):
            if "credit" in h:
                self.credit = h["credit"] - sum(r.size for r in self._pending.values())
            return self._flush()
        request = self._pending.get(h.get("req", -1))
        if msg.command == P.ERROR:
            if h.get("code") == "not_registered":  # one HELLO at a time: each WELCOME resends what waits
                if self._welcome_ok:
                    log.info("broker_forgot_us", peer=self.name)
                    self._rehello()
                return None
            if h.get("req") == self._hello_req:
                return self._on_hello_refused(h)
            if request is None:
                log.warning("broker_error", code=h.get("code"), message=h.get("message"))
                return None
        if request is None:
            return None  # a late reply to a request already answered or given up
        del self._pending[request.req]
        if request.future.cancelled():
            return self._flush()
        if msg.command == P.ERROR and h.get("code") == "storage_error" and not self._stopping:
            self._resend_later(request, h.get("message", ""))
        elif msg.command == P.ERROR:
            request.future.set_exception(BrokerError(h.get("code", "?"), h.get("message", "")))
        elif msg.command == P.ACK and request.command == P.PUT:
            self._on_ack(request, h)
        else:
            request.future.set_result(msg)
        self._flush()

    def _on_ack(self, request: _Request, h: dict[str, Any]) -> None:
        request.stored.extend(h.get("stored", []))
        request.duplicate.extend(h.get("duplicate", []))
        self.credit = h.get("credit", 0) - sum(r.size for r in self._pending.values())
        deferred = set(h.get("deferred", []))
        if not deferred:
            request.future.set_result({"stored": request.stored, "duplicate": request.duplicate})
            return
        metas = request.header["trajectories"]
        parts = P.split_payloads(metas, request.payloads[0])
        keep = [i for i, m in enumerate(metas) if m["id"] in deferred]
        request.header = {"trajectories": [metas[i] for i in keep]}
        request.payloads = [b"".join(parts[i] for i in keep)]
        request.req = next(self._ids)
        request.header["req"] = request.req
        self._held.appendleft(request)

    def _resend_later(self, request: _Request, reason: str) -> None:
        """The broker could not write what a request needed (a PUT's trajectories, a LEASE's record), and so did
        nothing: send it again after a backoff that doubles with each refusal, up to `backoff_max`, for as long
        as the peer is not stopping: a disk that filled up may be given space, and a failing one may recover."""
        request.refusals += 1
        delay = min(self.backoff_max, self.backoff_initial * 2 ** min(request.refusals, 32))
        log.warning("broker_storage_error", peer=self.name, command=request.command, reason=reason,
                    refusals=request.refusals, retry_in_s=round(delay, 2))
        self._later.append((time.monotonic() + delay, request))

    def _on_welcome(self, h: dict[str, Any]) -> None:
        was = self.welcome.get("run_id") if self.welcome else None
        if was is not None and h.get("run_id") != was:  # a broker restarted on another buffer directory
            log.warning("broker_run_changed", peer=self.name, was=was, now=h.get("run_id"),
                        hint="the broker serves another run now: its buffer, tasks and leases are not this run's")
        self.welcome = h
        self.credit = h.get("credit", 0)
        with self._weights_lock:
            if self.weights is None or h["weights"]["version"] >= self.weights["version"]:
                self._set_weights(h["weights"])
        self.hb = h.get("heartbeat_interval_s", self.hb)
        self.liveness = h.get("liveness", self.liveness)
        self._welcome_ok = True
        self._backoff = self.backoff_initial
        # Resend, in their original order, everything still waiting for a reply.
        resend = sorted(self._pending.values(), key=lambda r: r.req)
        self._pending.clear()
        self._held.extendleft(reversed(resend))
        if resend:
            log.info("requests_resent", peer=self.name, n=len(resend))
        self._welcomed.set()
        self._flush()

    def _on_bus(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != P.PROTOCOL:
            return
        try:
            state = P.unpack(frames[2])
        except Exception:
            return
        self._take_newer(state)

    def _take_newer(self, state: dict[str, Any]) -> bool:
        """A weight state, unless the one held is as new. A version is published twice when it is broadcast
        (announced, then with its checkpoint): newest wins."""
        key = (state.get("version", -1), state.get("published_at", 0.0))
        with self._weights_lock:  # the bus (I/O thread) and a STATUS read (the peer's thread) may both offer one
            if self.weights is None or key > (self.weights.get("version", -1), self.weights.get("published_at", 0.0)):
                self._set_weights(state)
                return True
        return False

    def _set_weights(self, state: dict[str, Any]) -> None:
        self.weights = state
        if self.on_weights is not None:
            self.on_weights(state)

    def _rehello(self) -> None:
        """HELLO (again): until WELCOME comes back, requests wait in the held queue."""
        self._welcome_ok = False
        self._hello_req = next(self._ids)
        hello = {"req": self._hello_req, "role": self.role, "name": self.name, "pid": os.getpid(),
                 "host": socket.gethostname(), "session": self.session, "policy_version": self.policy_version,
                 "capabilities": self.capabilities}
        if self.rollout:
            hello["rollout"] = self.rollout
        self._send(P.HELLO, hello)

    def _on_hello_refused(self, h: dict[str, Any]) -> None:
        """The broker refused our HELLO. A name still held by a peer that is going away is retried
        once it has expired (`retry_after_s`); anything else reaches the caller of `start` at once."""
        error = BrokerError(h.get("code", "?"), h.get("message", ""))
        retry = h.get("retry_after_s")
        first = not self._welcomed.is_set()
        retried = isinstance(retry, (int, float)) and (not first or time.monotonic() + retry < self._start_deadline)
        log.warning("hello_refused", peer=self.name, code=error.code, reason=error.message, retry_after_s=retry,
                    file_only=first and not retried)  # the caller of `start` says that one (as its `error: ...`)
        if retried:
            self._retry_hello_at = time.monotonic() + retry
            self._refused = error  # what `start` says if its time runs out before a retry is welcomed
            return
        if first:
            self._hello_error = error
            self._welcomed.set()
        else:  # refused on a reconnect for good: fail what waits rather than leave it hanging
            self._fail_all(error)
            self._stop.set()

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            outbox = list(self._outbox)
            self._outbox.clear()
        self._fail_outstanding(error, outbox)

    def _outstanding(self) -> list[_Request]:
        """Requests sent and unanswered, held back, or waiting to be resent."""
        return [*self._pending.values(), *self._held, *(r for _, r in self._later)]

    def _fail_outstanding(self, error: Exception, also: list[_Request] | None = None) -> None:
        for request in [*self._outstanding(), *(also or [])]:
            if not request.future.done():
                request.future.set_exception(error)
        self._pending.clear()
        self._held.clear()
        self._later.clear()

    def _timers(self) -> None:
        now = time.monotonic()
        if self._retry_hello_at and now >= self._retry_hello_at:
            self._retry_hello_at = 0.0
            self._rehello()
        if self._later and now >= min(at for at, _ in self._later):
            due = [r for at, r in self._later if at <= now]
            self._later = [(at, r) for at, r in self._later if at > now]
            for request in reversed(due):  # ahead of what is held: they were sent first
                request.req = next(self._ids)
                request.header["req"] = request.req
                self._held.appendleft(request)
            self._flush()
        silent = now - self._last_recv
        # Stopping, what waits fails once the broker has said nothing for the window since it was asked (with
        # nothing waiting, say mid-rollout, a silent broker is only reconnected to, as at any time): a broker
        # that a busy host starves for a moment costs no finished batch.
        with self._lock:
            waiting = [*self._outstanding(), *self._outbox] if self._stopping else []
        asked = min((r.submitted for r in waiting), default=now)
        if waiting and now - max(self._last_recv, asked) > self.liveness * self.hb:
            log.warning("broker_lost_while_stopping", peer=self.name, silent_s=round(silent, 2),
                        unanswered=len(waiting))
            self._stop.set()
            self._fail_all(BrokerUnreachable(f"the broker at {self.address} went silent while {self.name} "
                                             f"was stopping"))
            return
        if silent > self.liveness * self.hb:
            delay = min(self.backoff_max, self._backoff) * random.uniform(0.5, 1.0)
            log.warning("broker_unreachable", peer=self.name, address=self.address, silent_s=round(silent, 2),
                        retry_in_s=round(delay, 2))
            self._stop.wait(delay)
            self._backoff = min(self.backoff_max, self._backoff * 2)
            self.sock.close(0)
            self.reconnects += 1
            self._open()
            return
        if self._welcome_ok and now - self._last_send >= self.hb:
            self._send(P.HEARTBEAT, {"policy_version": self.policy_version})

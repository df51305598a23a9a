"""The broker client every rlbus peer uses.

One background thread owns the DEALER socket (ZeroMQ sockets are not
thread-safe) and, if asked, a SUB socket on the weight-version bus. Callers
on any thread submit requests and get futures back. The thread:

- says HELLO and waits for WELCOME; says it again whenever the broker answers
  `not_registered` (the broker restarted) or falls silent for
  `liveness × heartbeat_interval` (then it also reopens the socket, after a
  capped exponential backoff with jitter);
- sends HEARTBEATs while idle, so long generations or training steps never
  look like a dead peer;
- resends every request still waiting for its reply after each WELCOME:
  PUTs are idempotent by trajectory id, so a resend can never store twice;
- holds PUTs back while the broker's credit is used up, and resends the ids
  an ACK deferred once credit returns: nothing is dropped;
- resends a request the broker could not write for (`storage_error`: a
  full or failing disk; a PUT or a LEASE) after a backoff, until the peer is
  stopping.

The thread's half lives in `connection.py`. Request timeouts bound how long a caller waits; a PUT stays pending (and is
resent) until it is acknowledged unless its caller gives up on it.
"""

from __future__ import annotations

import itertools
import os
import queue
import socket
import threading
import time
import uuid
from collections import deque
from concurrent.futures import CancelledError, Future
from typing import TYPE_CHECKING, Any, Callable

import structlog
import zmq

from rlbus.common import protocol as P
from rlbus.common.connection import (BrokerError, BrokerUnreachable, Connection, NoWelcome,  # noqa: F401
                                     StoppedBeforeWelcome, _Request)
from rlbus.common.curve import client_keys
from rlbus.common.processes import stop_requested

if TYPE_CHECKING:
    from rlbus.common.broker_config import BrokerConfig

log = structlog.get_logger()


_NAMED = itertools.count()  # names this process has made


def default_name(role: str) -> str:
    """A peer name no other peer has: role, host, pid, how many names this process made before, and a random
    tag (for a pid the host gives out again later)."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{next(_NAMED)}-{uuid.uuid4().hex[:6]}"


def _unresolved(address: str) -> str | None:
    """The host of `address` when it is a name this host cannot resolve (else None)."""
    host = address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return host
    return None


class BrokerClient(Connection):
    def __init__(self, address: str, role: str, name: str | None = None, *, bus_address: str | None = None,
                 heartbeat_interval_s: float = 1.0, liveness: int = 5, backoff_initial_s: float = 0.1,
                 backoff_max_s: float = 5.0, policy_version: int = 0, capabilities: dict | None = None,
                 curve_server_key: str = "", curve_client_key: str = "", max_in_flight: int = 8,
                 on_weights: Callable[[dict], None] | None = None, ctx: zmq.Context | None = None,
                 rollout: dict[str, Any] | None = None):
        self.address = address
        self.bus_address = bus_address
        self.role = role
        self.session = uuid.uuid4().hex  # proves a reconnect on a new socket is this client again
        self.name = name or default_name(role)
        self.hb = heartbeat_interval_s
        self.liveness = liveness
        self.backoff_initial = backoff_initial_s
        self.backoff_max = backoff_max_s
        self.policy_version = policy_version
        self.capabilities = capabilities or {}
        self.rollout = rollout  # the rollout settings this peer was given; the broker checks they agree
        # The key files are read here: a missing one is a ConfigError to the caller, not a dead I/O thread.
        self.curve = client_keys(curve_server_key, curve_client_key) if curve_server_key else None
        self.max_in_flight = max_in_flight
        self.on_weights = on_weights
        self.ctx = ctx or zmq.Context.instance()
        self.welcome: dict[str, Any] | None = None
        self.weights: dict[str, Any] | None = None
        self.credit = 0
        self.reconnects = 0
        self._ids = itertools.count(1)
        self._outbox: deque[_Request] = deque()
        # Messages the broker sends on its own (EVAL for reward workers), for the peer's code to take.
        self.inbox: queue.Queue[P.Message] = queue.Queue()
        self._lock = threading.Lock()
        self._weights_lock = threading.Lock()
        self._unannounced = -1  # a version STATUS showed that the bus had not brought (`weights_from_status`)
        self._status_read = time.monotonic()  # the last STATUS `weights_from_status` sent (none: its first wait)
        self._welcomed = threading.Event()  # set by WELCOME, or by a refused first HELLO
        self._hello_error: Exception | None = None  # a refused first HELLO, or the I/O thread's failure
        self._refused: BrokerError | None = None  # the last refusal of a HELLO that is retried
        self._hello_req = -1
        self._retry_hello_at = 0.0
        self._start_deadline = float("inf")
        self._bye_sent = threading.Event()
        self._stop = threading.Event()
        self._stopping = False
        self._waits: dict[Future, str] = {}  # requests a caller of `request` waits on, and their commands
        self._give_up: frozenset[str] = frozenset()  # commands whose waits `stopping` ended
        # Not named by id(): a client made after one is closed may get its id while ZeroMQ still holds its address.
        self._wake_addr = f"inproc://rlbus-client-{uuid.uuid4().hex}"
        self._wake_rx = self.ctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self.ctx.socket(zmq.PAIR)
        self._wake_tx.connect(self._wake_addr)
        self._thread = threading.Thread(target=self._run, name=f"rlbus-client-{self.name}", daemon=True)

    # ---- caller side ------------------------------------------------------

    def start(self, timeout: float | None = 30.0) -> dict[str, Any]:
        """Connect and wait for WELCOME; returns its header. A refused HELLO raises BrokerError at once
        (a name held by a peer that is expiring is retried while `timeout` allows)."""
        self._start_deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
        self._thread.start()
        while not self._welcomed.wait(min(0.25, max(0.0, self._start_deadline - time.monotonic()))):
            if stop_requested():  # a stop signal (Ctrl-C) while the broker is not there: no need to wait it out
                self.close(bye=False, timeout=1)
                raise StoppedBeforeWelcome(f"stopped before the broker at {self.address} welcomed {self.name}")
            if time.monotonic() >= self._start_deadline:
                if self._refused is not None:  # refused until now (a name a live peer holds): say why
                    raise self._refused
                host = _unresolved(self.address)
                hint = f"its host {host!r} does not resolve here" if host else "is it running?"
                raise NoWelcome(f"no WELCOME from the broker at {self.address} within {timeout} s; {hint}")
        if self._hello_error is not None:
            self.close(bye=False)
            raise self._hello_error
        assert self.welcome is not None
        return self.welcome

    def submit(self, command: str, header: dict[str, Any] | None = None,
               payloads: list[bytes] | None = None) -> Future:
        request = _Request(command, dict(header or {}), list(payloads or []))
        with self._lock:
            if self._stop.is_set():  # nothing would ever send it
                request.future.set_exception(BrokerUnreachable(f"{command}: the broker client has stopped"))
                return request.future
            self._outbox.append(request)
            self._wake_tx.send(b"", zmq.NOBLOCK)
        return request.future

    def weights_from_status(self, every_s: float = 5.0) -> None:
        """For a peer waiting for a version, called as often as it likes: every `every_s`, ask STATUS for the
        broker's weights. A version that two such reads in a row show and the bus has still not brought is taken
        from STATUS, with a warning: this peer's bus is not the broker's (`broker.pub_port` or `pub_address` set
        otherwise than the broker has them), which would otherwise leave it waiting without a word."""
        now = time.monotonic()
        if now - self._status_read < every_s:
            return
        self._status_read = now
        try:
            state = self.request(P.STATUS, {}, timeout=every_s).header.get("weights") or {}
        except (TimeoutError, BrokerError, BrokerUnreachable, CancelledError):  # a broker away, or stopping: wait on
            return
        version, shown = state.get("version", -1), self._unannounced
        held = (self.weights or {}).get("version", -1)
        self._unannounced = version if version > held else -1
        if version > held and version == shown and self._take_newer(state):
            log.warning("weights_not_on_bus", peer=self.name, policy_version=version, bus=self.bus_address,
                        hint="this peer's bus is not the broker's: set broker.pub_port (or broker.pub_address) "
                             "as the broker has it; versions come through STATUS meanwhile")

    def stopping(self, give_up: tuple[str, ...] = ()) -> None:
        """The peer is stopping. From now on a broker that goes silent (past `liveness` heartbeats) fails
        every request that waits with BrokerUnreachable and stops the client, instead of being reconnected
        to for as long as it takes: a stopping peer whose broker has gone (the whole run is stopping) exits.

        `request`s of the commands in `give_up`, waiting now or made later, end at once with CancelledError: a
        FETCH that the broker holds until data comes (up to its `wait_ms`) is not waited out. A reply that comes
        after is dropped; the broker delivers the same batch again to the next FETCH of that step."""
        self._give_up = self._give_up | frozenset(give_up)
        self._stopping = True
        for future, command in list(self._waits.items()):
            if command in self._give_up:
                future.cancel()

    @property
    def is_stopping(self) -> bool:
        return self._stopping

    def request(self, command: str, header: dict[str, Any] | None = None, payloads: list[bytes] | None = None,
                timeout: float | None = 30.0) -> P.Message:
        """Send a request and wait for its reply; raises BrokerError on ERROR, TimeoutError on timeout,
        CancelledError once `stopping` gave up its command."""
        future = self.submit(command, header, payloads)
        self._waits[future] = command
        if command in self._give_up:  # `stopping` came between the two lines above
            future.cancel()
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"{command}: no reply from the broker within {timeout} s") from None
        finally:
            del self._waits[future]

    def send(self, command: str, header: dict[str, Any]) -> None:
        """Send a message that gets no reply (a reward worker's RESULT); sent once connected."""
        self.submit(command, dict(header, _oneway=True))

    def put(self, items: list[tuple[dict[str, Any], bytes]], timeout: float | None = None) -> dict[str, list[str]]:
        """Store trajectories; returns once all are durable at the broker ({stored, duplicate})."""
        return self.put_async(items).result(timeout)

    def put_async(self, items: list[tuple[dict[str, Any], bytes]]) -> Future:
        metas = [dict(m) for m, _ in items]
        frame = P.join_payloads(metas, [p for _, p in items])
        return self.submit(P.PUT, {"trajectories": metas}, [frame])

    def close(self, bye: bool | dict[str, Any] = True, timeout: float = 5.0) -> None:
        """Say BYE (after pending requests are answered, up to `timeout`), with `bye`'s fields if it is a map,
        and stop the thread."""
        if self._thread.is_alive():
            if bye:
                self.submit(P.BYE, bye if isinstance(bye, dict) else {})
                deadline = time.monotonic() + timeout
                while self._thread.is_alive() and time.monotonic() < deadline and not self._bye_sent.is_set():
                    time.sleep(0.01)
            self._stop.set()
            with self._lock:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            self._thread.join(timeout)
        with self._lock:
            self._wake_tx.close(0)
        if not self._thread.is_alive():
            self._wake_rx.close(0)

    # ---- the I/O thread ---------------------------------------------------


def check_admission(broker: BrokerConfig, rollout: dict[str, Any], wait_s: float = 3.0) -> None:
    """Ask the broker, as a tool, whether a peer with these rollout settings would be admitted, before the process
    loads its model (seconds; minutes for a large one on a GPU), so that a refusal comes first: raises its
    BrokerError (`conflict`, naming each field that differs). A tool's HELLO pins nothing. A broker that does not
    answer within `wait_s` refuses nothing: the process goes on, and says HELLO once it is ready."""
    client = BrokerClient(broker.address, "tool", rollout=rollout, curve_server_key=broker.curve_server_key,
                          curve_client_key=broker.curve_client_key)
    try:
        client.start(wait_s)
    except NoWelcome:
        client.close(bye=False, timeout=1)
        return
    client.close()

"""What the weight server sends: every reply reaches its client, in the order it was given, unless the client
has stopped reading.

The server's ROUTER keeps at most 16 replies per client in ZeroMQ's queue (`sndhwm`: a client that stops
reading holds 64 MB of 4 MB chunks at most). A plain ROUTER drops a reply that finds the queue full, and it
may find it full while the client reads everything: the socket counts what the client's side has taken only
in steps of half the queue, and only when it next processes its commands (at most every millisecond while it
sends). A client asking for many small replies at once (64 requests in flight) lost a quarter of them so, and
waited for its own silence to ask again. With ROUTER_MANDATORY a full queue refuses the reply instead
(EAGAIN); it then waits here, with the client's later replies behind it, until the queue takes it. What waits
for one client is bounded (`MAX_HELD_BYTES`, `MAX_HELD`): past that the client is not reading, and its replies
are dropped as before (it asks again after its silence).
"""

from __future__ import annotations

from collections import deque

import structlog
import zmq

log = structlog.get_logger()

MAX_HELD = 1024  # replies held for one client
MAX_HELD_BYTES = 64 << 20  # their bytes


class _Held:
    __slots__ = ("replies", "bytes", "warned")

    def __init__(self):
        self.replies: deque[list] = deque()
        self.bytes = 0
        self.warned = False


class Replies:
    """The outgoing side of a ROUTER: `send` now or hold, `flush` what is held (call it after every poll)."""

    def __init__(self, sock: zmq.Socket):
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock = sock
        self._held: dict[bytes, _Held] = {}  # per client, replies its queue has not taken yet
        self.dropped = 0

    @property
    def pending(self) -> bool:
        return bool(self._held)

    def send(self, ident: bytes, frames: list) -> None:
        """Send `frames` to the client `ident` (ZeroMQ keeps no copy of them: they must not change), or hold
        them behind what already waits for it; dropped for a client that is gone or past its bounds."""
        held = self._held.get(ident)
        if held is None:
            if self._try(ident, frames) is not zmq.Again:
                return
            held = self._held[ident] = _Held()
        size = sum(len(f) for f in frames)
        if len(held.replies) >= MAX_HELD or held.bytes + size > MAX_HELD_BYTES:
            if not held.warned:
                log.warning("weights_replies_dropped", held=len(held.replies), held_mb=round(held.bytes / 2**20, 1),
                            note="a client that does not read its replies: it asks again after its silence")
                held.warned = True
            self.dropped += 1
            return
        held.replies.append(frames)
        held.bytes += size

    def flush(self) -> None:
        """Send what is held, in order, as far as each client's queue takes it."""
        for ident in list(self._held):
            held = self._held[ident]
            while held.replies:
                result = self._try(ident, held.replies[0])
                if result is zmq.Again:
                    break
                held.bytes -= sum(len(f) for f in held.replies.popleft())
                if result is not None:  # the client is gone: the rest would go nowhere
                    held.replies.clear()
            if not held.replies:
                del self._held[ident]

    def _try(self, ident: bytes, frames: list):
        """None when sent; zmq.Again when the client's queue is full; the error when the client is gone."""
        try:
            self.sock.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return zmq.Again
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            return exc
        return None

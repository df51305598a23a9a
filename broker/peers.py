"""The broker's peer registry: who is connected, in which role, and when each was last heard.

Peers are known by routing identity (what the ROUTER sees) and by name (what
they say in HELLO). A HELLO under a known name with the same `session` (a
token a client keeps for its whole life) replaces the old identity, so a peer
that reconnects keeps its name and with it its task leases; another process
under a live peer's name is refused until that peer leaves or expires. Any
message refreshes `last_seen`; peers silent for longer than the liveness
window are handed back by `silent` for the broker to drop. Silence is counted
only while the broker listens: a turn of its loop that takes longer than it
should (the process starved on a loaded host, or stopped) is time in which
its peers' messages waited unread, and it does not count against them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass(slots=True)
class Peer:
    name: str
    role: str
    identity: bytes
    last_seen: float
    heard: float  # last_seen on the listening clock (`Peers.turn`)
    policy_version: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    last_sent: float = 0.0
    starved: bool = False  # given zero credit: owed a CREDIT when room frees up
    fetched: bool = False  # a trainer that has FETCHed since it said HELLO: its steps advance one at a time
    joined: float = 0.0  # when it said HELLO on this connection


class Peers:
    def __init__(self) -> None:
        self._by_identity: dict[bytes, Peer] = {}
        self._by_name: dict[str, Peer] = {}
        self._away = 0.0  # seconds the broker was not listening: the listening clock is now - _away
        self._last_turn: float | None = None

    def turn(self, now: float, longest: float) -> float:
        """At every turn of the broker's loop: a gap since the last turn beyond `longest` is time the broker did
        not read its socket, kept off every peer's silence; returns the gap (0.0 when the turn was on time)."""
        previous, self._last_turn = self._last_turn, now
        gap = 0.0 if previous is None else now - previous
        if gap <= longest:
            return 0.0
        self._away += gap - longest
        for peer in self._by_identity.values():  # read during this turn, before or after the stall: as of its end
            if peer.last_seen > previous:
                peer.heard = now - self._away
        return gap

    def clock(self, now: float) -> float:
        """The listening clock: `now` less the time the broker was not reading (see `turn`)."""
        return now - self._away

    def heard(self, peer: Peer, now: float) -> None:
        peer.last_seen, peer.heard = now, now - self._away

    def silence(self, peer: Peer, now: float) -> float:
        """How long the broker has listened without hearing from `peer`."""
        return now - self._away - peer.heard

    def get(self, identity: bytes) -> Peer | None:
        return self._by_identity.get(identity)

    def __contains__(self, identity: bytes) -> bool:
        return identity in self._by_identity

    def __len__(self) -> int:
        return len(self._by_identity)

    def __iter__(self) -> Iterator[Peer]:
        return iter(list(self._by_identity.values()))

    def other_trainer(self, name: str) -> Peer | None:
        """A connected trainer under another name (a run has one trainer)."""
        return next((p for p in self._by_name.values() if p.role == "trainer" and p.name != name), None)

    def holder(self, hello: dict[str, Any], identity: bytes) -> Peer | None:
        """A live peer on another connection that holds the HELLO's name and is not the same peer.

        A peer proves it is the same one (reconnecting on a new socket) by its
        HELLO `session`, which a client keeps for its whole life.
        """
        old = self._by_name.get(hello["name"])
        if old is None or old.identity == identity:
            return None
        session = hello.get("session")
        return None if session is not None and old.info.get("session") == session else old

    def join(self, identity: bytes, hello: dict[str, Any], now: float) -> tuple[Peer, bool]:
        """Register the sender of a HELLO; returns the peer and whether its name was known (a reconnect)."""
        old = self._by_name.get(hello["name"])
        if old is not None:
            self._by_identity.pop(old.identity, None)
        peer = Peer(hello["name"], hello["role"], identity, now, now - self._away, hello.get("policy_version", 0),
                    {"pid": hello.get("pid"), "host": hello.get("host"), "session": hello.get("session"),
                     "capabilities": hello.get("capabilities", {})}, joined=now)
        self._by_identity[identity] = peer
        self._by_name[peer.name] = peer
        return peer, old is not None

    def remove(self, peer: Peer) -> None:
        self._by_identity.pop(peer.identity, None)
        if self._by_name.get(peer.name) is peer:
            del self._by_name[peer.name]

    def silent(self, now: float, expiry: float) -> list[Peer]:
        return [p for p in self._by_identity.values() if self.silence(p, now) > expiry]

"""The weight-version bus: the latest weight state, kept durably and put on the PUB socket.

The state is `{version, method, location, digest, step, published_at}`,
with `broadcast` while an epoch is announced and `fetch_from` (and
`fetch_key`) where the trainer serves its versions over the network;
version 0 with an empty location is the initial model. A PUBLISH replaces it
(never with an older version), stores it beside the buffer, and sends it at
once; `tick` sends it again every `republish_interval_s`, because PUB drops
messages for subscribers that are still connecting. Never deltas: one
message is enough to know everything (the Clone pattern's snapshot).

The state also says when the run is over: a trainer that has taken its last
step says so in its BYE, and the state gains `finished: true` (re-stamped, so
that clients take it) until a trainer says HELLO again or a version is
published.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
import zmq

from rlbus.broker.store import Store
from rlbus.common import protocol as P

log = structlog.get_logger()

METHODS = ("checkpoint", "nccl")


class WeightBus:
    def __init__(self, pub: zmq.Socket, store: Store, republish_s: float):
        self.pub = pub
        self.store = store
        self.republish_s = republish_s
        self.state: dict[str, Any] = store.get_meta("weights") or {
            "version": 0, "method": "checkpoint", "location": "", "digest": "", "step": 0, "published_at": 0.0}
        self._last = 0.0

    def publish(self, h: dict[str, Any]) -> P.ProtocolError | None:
        """Take a PUBLISH header; returns the error to answer with, or None once it is stored and sent."""
        if h["method"] not in METHODS:
            return P.ProtocolError("bad_field", f"PUBLISH: method {h['method']!r} is not one of {METHODS}")
        fetch_from = h.get("fetch_from")
        if fetch_from is not None and not P.dialable(fetch_from):
            return P.ProtocolError("bad_field", f"PUBLISH: fetch_from {P.brief(fetch_from)} is not tcp://HOST:PORT "
                                                "(PORT 1 to 65535)")
        if h["version"] > 0 and not h["location"] and not h.get("broadcast"):
            return P.ProtocolError("bad_field", f"PUBLISH: version {h['version']} has an empty location and no "
                                                "broadcast, so no explorer could load it")
        if h["version"] < self.state["version"]:
            return P.ProtocolError("conflict", f"version {h['version']} is older than the published "
                                               f"{self.state['version']}")
        state = {"version": h["version"], "method": h["method"], "location": h["location"],
                 "digest": h["digest"], "step": h.get("step", h["version"]), "published_at": time.time()}
        for key in ("broadcast", "fetch_from", "fetch_key"):
            if h.get(key):
                state[key] = h[key]
        self.store.set_meta("weights", state)  # recorded first: a disk error leaves the version published as it was
        self.state = state
        log.info("weights_published", policy_version=h["version"], method=h["method"], location=h["location"],
                 epoch=h["broadcast"]["epoch"] if h.get("broadcast") else None)
        self.send()
        return None

    @property
    def finished(self) -> bool:
        return bool(self.state.get("finished"))

    def finish(self, finished: bool) -> None:
        """The run is over (`finished`), or goes on: the state says so from now on, durably, and at once."""
        if finished == self.finished:
            return
        state = {k: v for k, v in self.state.items() if k != "finished"}
        state.update({"published_at": time.time(), **({"finished": True} if finished else {})})
        self.store.set_meta("weights", state)
        self.state = state
        log.info("run_finished" if finished else "run_reopened", policy_version=state["version"], step=state["step"])
        self.send()

    def send(self) -> None:
        self.pub.send_multipart([P.TOPIC_WEIGHTS, P.PROTOCOL, P.pack(self.state)])
        self._last = time.time()

    def tick(self, now: float) -> None:
        if now - self._last >= self.republish_s:
            self.send()

"""The trainer's check, while it waits on a broadcast, that every member of the epoch is still at the broker.

The broker is a stand-in that answers STATUS as given; the real path (a member SIGSTOPped mid-broadcast, a real
broker dropping it) is tests/explorer/test_broadcast_sync.py's.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlbus.common import protocol as P
from rlbus.weights.broadcaster import BroadcastSender
from rlbus.weights.comm import BroadcastError


class Broker:
    """Answers STATUS with `uptime_s` and the peers named; or times out, like a broker that is not there."""

    liveness, hb = 5, 0.2  # as the client took them from WELCOME: a liveness window of 1 s

    def __init__(self, uptime_s: float | None, peers: list[str]):
        self.uptime_s, self.peers = uptime_s, peers

    def request(self, command: str, header: dict, timeout: float):
        assert command == P.STATUS
        if self.uptime_s is None:
            raise TimeoutError(f"{command}: no reply from the broker within {timeout} s")
        return SimpleNamespace(header={"uptime_s": self.uptime_s, "peers": [{"name": n} for n in self.peers]})


def check(broker: Broker, members: list[str]):
    return BroadcastSender._still_listed(SimpleNamespace(client=broker, epoch=3), members)


def test_a_member_the_broker_no_longer_lists_ends_the_wait():
    with pytest.raises(BroadcastError, match="epoch 3: the broker no longer lists ex-b"):
        check(Broker(60.0, ["trainer", "ex-a"]), ["ex-a", "ex-b"])()


def test_members_all_listed_or_a_broker_that_cannot_tell_let_the_wait_go_on():
    check(Broker(60.0, ["trainer", "ex-a", "ex-b"]), ["ex-a", "ex-b"])()
    check(Broker(None, []), ["ex-a", "ex-b"])()  # no answer: no news of the members
    # Restarted 1.9 s ago, under two liveness windows (2 s): a member still there may not have said HELLO yet.
    check(Broker(1.9, ["trainer"]), ["ex-a", "ex-b"])()
    with pytest.raises(BroadcastError, match="ex-a, ex-b"):
        check(Broker(2.1, ["trainer"]), ["ex-a", "ex-b"])()

"""The peer registry's liveness: silence is counted only while the broker listens."""

from __future__ import annotations

import pytest

from rlbus.broker.peers import Peers


def regular_turns(peers: Peers, start: float, end: float, every: float = 0.5) -> None:
    t = start
    while t < end:
        t += every
        assert peers.turn(t, longest=1.0) == 0.0


def test_a_peer_heard_from_is_kept_and_one_silent_past_the_window_is_handed_back():
    peers = Peers()
    talker, _ = peers.join(b"t", {"name": "talker", "role": "explorer"}, now=100.0)
    mute, _ = peers.join(b"m", {"name": "mute", "role": "explorer"}, now=100.0)
    peers.turn(100.0, longest=1.0)
    for t in (102.0, 104.0):
        regular_turns(peers, t - 2.0, t)
        peers.heard(talker, t)
    regular_turns(peers, 104.0, 105.0)
    assert peers.silent(105.0, expiry=5.0) == []  # mute: 5.0 s, not more
    regular_turns(peers, 105.0, 105.5)
    assert peers.silent(105.5, expiry=5.0) == [mute]
    assert talker.last_seen == 104.0


def test_the_brokers_own_stall_is_kept_off_every_peers_silence():
    """Ten seconds in which the broker read nothing (a starved or stopped process): its peers' messages waited
    unread, so none of them is dropped for it; once it listens again, silence counts as before."""
    peers = Peers()
    talker, _ = peers.join(b"t", {"name": "talker", "role": "explorer"}, now=100.0)
    mute, _ = peers.join(b"m", {"name": "mute", "role": "explorer"}, now=100.0)
    peers.turn(100.0, longest=1.0)
    regular_turns(peers, 100.0, 101.0)
    assert peers.turn(111.0, longest=1.0) == 10.0
    assert peers.silent(111.0, expiry=5.0) == []  # 2 s of listening since both were heard
    assert peers.silence(mute, 111.0) == 2.0 and talker.last_seen == 100.0
    peers.heard(talker, 111.1)  # the heartbeat that waited in the socket, read on the next turn
    regular_turns(peers, 111.0, 114.0)
    assert peers.silent(114.0, expiry=5.0) == []
    regular_turns(peers, 114.0, 114.5)
    assert peers.silent(114.5, expiry=5.0) == [mute]
    assert peers.silence(talker, 114.5) == pytest.approx(114.5 - 111.1)


def test_a_broker_slow_at_every_turn_still_drops_a_silent_peer():
    """Under a load that makes every turn take 3 s (longer than it should by 2), 1 s of each still counts."""
    peers = Peers()
    mute, _ = peers.join(b"m", {"name": "mute", "role": "explorer"}, now=0.0)
    peers.turn(0.0, longest=1.0)
    t = 0.0
    for _ in range(5):
        t += 3.0
        assert peers.turn(t, longest=1.0) == 3.0
    assert peers.silent(t, expiry=5.0) == []
    t += 3.0
    peers.turn(t, longest=1.0)
    assert peers.silent(t, expiry=5.0) == [mute]


def test_a_peer_read_in_the_stalled_turn_is_silent_from_the_turns_end():
    """A message read in the same turn as a stall (before it or after it: the broker cannot tell) counts as heard
    at the turn's end, so the stall is neither counted against that peer nor added to its life after it."""
    for read_at in (100.2, 110.4):  # just before the process starves for ten seconds, or just after
        peers = Peers()
        peer, _ = peers.join(b"p", {"name": "late", "role": "explorer"}, now=100.0)
        peers.turn(100.0, longest=1.0)
        peers.heard(peer, read_at)
        assert peers.turn(110.5, longest=1.0) == 10.5
        assert peers.silence(peer, 110.5) == 0.0
        regular_turns(peers, 110.5, 115.5)
        assert peers.silent(115.5, expiry=5.0) == []
        regular_turns(peers, 115.5, 116.0)
        assert peers.silent(116.0, expiry=5.0) == [peer]

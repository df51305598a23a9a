"""What the broker does for streaming explorers: staleness from a trajectory's oldest token, and swap slots."""

from __future__ import annotations

import time

import pytest

from rlbus.common import protocol as P
from rlbus.common.client import BrokerError
from tests.conftest import group


def spanning(gid: str, first: int, last: int, size: int = 2):
    """A group whose samples were generated across a weight swap: tokens from `first` up to `last`."""
    items = group(gid, size, version=first)
    for meta, _ in items:
        meta["last_version"] = last
    return items


def test_staleness_counts_from_the_oldest_token(broker_factory, clients):
    """max_staleness 1, trainer at step 3: a group begun under version 1 is retired as too stale even though its
    last tokens came from version 3; one begun under version 2 is trained."""
    b = broker_factory("sync.sync_style=async", "sync.max_staleness=1", "data.batch_tasks=1")
    ex, tr = clients(b, "explorer", "ex"), clients(b, "trainer", "tr")
    ex.put(spanning("old", 1, 3) + spanning("new", 2, 3))
    reply = tr.request(P.FETCH, {"step": 3, "max_groups": 4})  # a trainer's first FETCH may name any step
    assert reply.command == P.BATCH
    assert [g["group_id"] for g in reply.header["groups"]] == ["new"] and reply.header["expired"] == 2
    assert all(t["last_version"] == 3 for t in reply.header["groups"][0]["trajectories"])


def test_last_version_older_than_the_first_is_refused(broker_factory, clients):
    b = broker_factory()
    ex = clients(b, "explorer", "ex")
    with pytest.raises(BrokerError, match="last_version 1 is older than its policy_version 2"):
        ex.put(spanning("g", 2, 1))


def test_swap_slots_admit_max_swapping_explorers_at_once(broker_factory, clients):
    b = broker_factory("sync.max_swapping=1", "sync.swap_timeout_s=2", "broker.heartbeat_interval_s=0.2")
    first, second, third = (clients(b, "explorer", f"ex-{i}") for i in range(3))
    assert first.welcome["sync"]["max_swapping"] == 1
    assert first.request(P.SWAP, {"phase": "begin", "version": 1}).command == P.OK
    assert first.request(P.SWAP, {"phase": "begin", "version": 1}).command == P.OK  # a resend: still its slot
    wait = second.request(P.SWAP, {"phase": "begin", "version": 1})
    assert wait.command == P.WAIT and wait.header["reason"] == "swapping" and wait.header["swapping"] == ["ex-0"]
    assert first.request(P.SWAP, {"phase": "end", "version": 1}).command == P.OK
    assert second.request(P.SWAP, {"phase": "begin", "version": 1}).command == P.OK
    second.close(bye=True)  # a holder that leaves frees its slot
    assert third.request(P.SWAP, {"phase": "begin", "version": 1}).command == P.OK
    assert first.request(P.SWAP, {"phase": "begin", "version": 2}).command == P.WAIT
    deadline = time.monotonic() + 10  # a holder that never gives it back loses it after swap_timeout_s
    while first.request(P.SWAP, {"phase": "begin", "version": 2}).command != P.OK:
        assert time.monotonic() < deadline, "the slot was never freed"
        time.sleep(0.1)
    reasons = [(e["peer"], e["reason"]) for e in b.log_events() if e["event"] == "swap_released"]
    assert reasons == [("ex-0", "done"), ("ex-1", "bye"), ("ex-2", "timeout")]


def test_only_explorers_swap_and_phases_are_checked(broker_factory, clients):
    b = broker_factory()
    tr, ex = clients(b, "trainer", "tr"), clients(b, "explorer", "ex")
    with pytest.raises(BrokerError, match="bad_role|SWAP is for explorers"):
        tr.request(P.SWAP, {"phase": "begin", "version": 1})
    with pytest.raises(BrokerError, match="phase"):
        ex.request(P.SWAP, {"phase": "later", "version": 1})
    assert ex.request(P.SWAP, {"phase": "begin", "version": 1}).command == P.OK  # 0: no limit
    assert clients(b, "explorer", "ex-b").request(P.SWAP, {"phase": "begin", "version": 1}).command == P.OK

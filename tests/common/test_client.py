"""The shared client: heartbeats keep idle peers alive, reconnects resend, timeouts are bounded."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from rlbus.common import protocol as P
from rlbus.common.client import BrokerClient, BrokerUnreachable, default_name
from tests.conftest import group


def test_idle_client_stays_registered_through_heartbeats(broker, clients):
    """A peer that sends no requests for several liveness periods is not dropped."""
    quiet = clients(broker, "explorer", "quiet")
    time.sleep(0.2 * 5 * 3)  # three times liveness x interval
    tool = clients(broker, "tool", "look")
    assert "quiet" in {p["name"] for p in tool.request(P.STATUS).header["peers"]}
    assert quiet.reconnects == 0


def test_put_made_while_broker_is_down_is_stored_after_restart(broker, clients):
    """Requests wait through a broker restart, are resent after HELLO, and complete."""
    c = clients(broker, "explorer", "patient")
    broker.kill(signal.SIGKILL)
    pending = c.put_async(group("late"))
    time.sleep(1.5)  # long enough for the client to notice and start reconnecting
    assert not pending.done()
    broker.start()
    assert sorted(pending.result(20)["stored"]) == ["late.0", "late.1"]
    assert c.reconnects >= 1


def test_default_names_are_unique_to_each_start_and_say_whose_they_are():
    """No two peers a process starts share a name (a random tag alone repeats: 24 bits in 20,000 draws)."""
    names = {default_name("explorer") for _ in range(20_000)}
    assert len(names) == 20_000
    assert all(n.startswith(f"explorer-{socket.gethostname()}-{os.getpid()}-") for n in names)


def test_request_timeout_is_bounded():
    c = BrokerClient("tcp://127.0.0.1:1", "tool", "nobody", heartbeat_interval_s=0.1)
    with pytest.raises(TimeoutError, match="no WELCOME"):
        c.start(0.5)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="STATUS"):
        c.request(P.STATUS, timeout=0.3)
    assert time.monotonic() - t0 < 2
    c.close(bye=False, timeout=1)


def test_close_fails_outstanding_requests_instead_of_leaving_them_waiting(broker, clients):
    """A FETCH held at the broker when the client says BYE ends with an error, not a hang."""
    t = clients(broker, "trainer", "leaving")
    pending = t.submit(P.FETCH, {"step": 0, "max_groups": 1, "wait_ms": 60000})
    time.sleep(0.2)
    t.close(bye=True)
    with pytest.raises(ConnectionError, match="BYE"):
        pending.result(5)


def test_a_stopping_client_gives_up_on_a_broker_that_has_gone(broker, clients):
    """Before stopping() the client waits out a broker restart (above); after it, a silent broker fails
    what waits, and what comes later, with BrokerUnreachable instead of reconnecting forever."""
    c = clients(broker, "explorer", "leaving")
    c.stopping()
    broker.kill(signal.SIGKILL)
    pending = c.put_async(group("unsaid"))
    with pytest.raises(BrokerUnreachable, match="went silent while leaving was stopping"):
        pending.result(30)
    with pytest.raises(BrokerUnreachable, match="stopped"):
        c.request(P.STATUS, timeout=5)


def test_a_stopping_client_with_nothing_waiting_outlasts_a_broker_that_pauses(broker, clients):
    """An explorer finishing its last batch (stopping, nothing asked yet) while a loaded host starves the broker
    past the liveness window: that costs a reconnect, not the batch."""
    c = clients(broker, "explorer", "patient")
    c.stopping()
    os.kill(broker.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(0.2 * 5 * 3)  # three times liveness x interval without a word from the broker
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)
    assert sorted(c.put(group("finished"), timeout=10)["stored"]) == ["finished.0", "finished.1"]


def test_a_stopping_client_still_finishes_with_a_broker_that_answers(broker, clients):
    c = clients(broker, "explorer", "tidy")
    c.stopping()
    time.sleep(0.2 * 5 * 2)  # twice liveness x interval: heartbeats keep it alive
    assert sorted(c.put(group("last"), timeout=10)["stored"]) == ["last.0", "last.1"]

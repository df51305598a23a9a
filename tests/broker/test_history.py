"""The broker's record of what it delivered (for `rlbus replay`): every BATCH rebuilt exactly as sent."""

from __future__ import annotations

import pytest

from rlbus.broker.history import DeliveredBatches
from rlbus.common import protocol as P
from tests.conftest import group


def _sent(msg: P.Message) -> tuple[dict, bytes]:
    header = {k: v for k, v in msg.header.items() if k != "req"}
    return header, b"".join(bytes(p) for p in msg.payloads)


def test_every_delivered_batch_is_rebuilt_as_sent_committed_or_not(broker_factory, clients):
    broker = broker_factory("sync.max_staleness=4")
    ex = clients(broker, "explorer", "ex")
    ex.put(group("flat", size=2, rewards=[1.0, 1.0]), timeout=5)  # all-equal: skipped by the FETCH below
    for i in range(3):
        ex.put(group(f"g{i}", size=3), timeout=5)
    tr = clients(broker, "trainer", "tr")
    fetch = {"max_groups": 2, "min_groups": 1, "skip_zero_spread": True}
    b0 = tr.request(P.FETCH, {"step": 0, **fetch})
    assert b0.header["skipped"] == 2
    tr.close(bye=True)
    # A trainer that restarts gets step 0's batch again, the same in every respect (its skipped count too).
    tr = clients(broker, "trainer", "tr-restarted")
    assert _sent(tr.request(P.FETCH, {"step": 0, **fetch})) == _sent(b0)
    tr.request(P.COMMIT, {"step": 0})
    ex.put(group("flat2", size=2, rewards=[0.0, 0.0]), timeout=5)
    b1 = tr.request(P.FETCH, {"step": 1, **fetch})
    assert b1.header["skipped"] == 2 and [g["group_id"] for g in b1.header["groups"]] == ["g2"]

    with DeliveredBatches(broker.data_dir) as history:  # read-only, beside the running broker
        rebuilt = [(step, _sent(msg), committed) for step, msg, committed in history]
    assert rebuilt == [(0, _sent(b0), True), (1, _sent(b1), False)]
    # and after a restart of the broker, from what it recovered
    broker.stop()
    broker.proc.wait(30)
    restarted = broker_factory("sync.max_staleness=4", data_dir=broker.data_dir)
    assert _sent(clients(restarted, "trainer", "tr-3").request(P.FETCH, {"step": 1, **fetch})) == _sent(b1)


def test_a_directory_without_a_catalogue_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no broker catalogue"):
        DeliveredBatches(tmp_path)

"""The broker's own measurements (BufferStats): what /metrics exposes of the batches it delivered."""

from __future__ import annotations

from types import SimpleNamespace

from rlbus.broker.metrics import BufferStats


def group(*versions: int) -> SimpleNamespace:
    return SimpleNamespace(trajs=[SimpleNamespace(policy_version=v) for v in versions])


def test_delivered_trajectories_are_counted_by_their_staleness_at_the_step():
    stats = BufferStats()
    stats.delivered(5, [group(3, 3, 2), group(5)])
    stats.delivered(6, [group(5, 5)])
    assert (stats.delivered_batches, stats.delivered_trajectories) == (2, 6)
    assert dict(stats.staleness.cumulative())["0"] == 1  # the v5 sample at step 5
    assert [n for _, n in stats.staleness.cumulative()][:4] == [1, 3, 5, 6]  # staleness 0, 1, 2, 3
    assert stats.staleness.sum == 2 + 2 + 3 + 0 + 1 + 1

"""The broker's metrics: what its loop measures (`BufferStats`, always kept) and, with
`metrics.prometheus_port`, their exposition with the buffer's state on `/metrics` (`BrokerCollector`).

PromQL rates give the flows: ingest is `rate(rlbus_broker_trajectories_total{state="stored"}[1m])`, fetch is
`rate(rlbus_broker_delivered_trajectories_total[1m])`.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any, Iterator

from rlbus.common.telemetry import SECONDS, STALENESS, start


class Histogram:
    """Counts per bucket (upper bounds `buckets`, then +Inf), as Prometheus histograms keep them."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += n
        self.sum += value * n

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, count in zip([*map(str, self.buckets), "+Inf"], self.counts):
            total += count
            out.append((bound, total))
        return out


class BufferStats:
    def __init__(self):
        self.put_ack = Histogram(SECONDS)  # from taking a PUT off the socket to its ACK (after the group commit)
        self.staleness = Histogram(STALENESS)  # of each delivered trajectory: step - its policy version
        self.delivered_trajectories = 0
        self.delivered_batches = 0

    def delivered(self, step: int, groups: list) -> None:
        versions = Counter(traj.policy_version for group in groups for traj in group.trajs)
        self.delivered_batches += 1
        self.delivered_trajectories += versions.total()
        for version, n in versions.items():
            self.staleness.observe(step - version, n)


class BrokerCollector:
    """The broker's state, read when Prometheus scrapes (on the HTTP server's thread: reads only)."""

    def __init__(self, broker):
        self.broker = broker

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        b = self.broker
        stats: BufferStats = b.buffer.stats
        yield GaugeMetricFamily("rlbus_broker_buffer_depth", "Trajectories stored and not yet retired",
                                value=b.store.depth)
        states = CounterMetricFamily("rlbus_broker_trajectories", "Trajectories stored, and retired by how "
                                     "(committed, expired, skipped)", labels=["state"])
        for state, n in dict(b.store.counts).items():
            states.add_metric([state], n)
        yield states
        yield CounterMetricFamily("rlbus_broker_delivered_trajectories", "Trajectories delivered to the trainer",
                                  value=stats.delivered_trajectories)
        yield CounterMetricFamily("rlbus_broker_delivered_batches", "Batches delivered to the trainer",
                                  value=stats.delivered_batches)
        yield GaugeMetricFamily("rlbus_broker_policy_version", "Newest policy version announced on the bus",
                                value=b.bus.state["version"])
        yield GaugeMetricFamily("rlbus_broker_trainer_step", "The trainer's newest step", value=b.buffer.trainer_step)
        peers = GaugeMetricFamily("rlbus_broker_peers", "Connected peers by role", labels=["role"])
        roles: dict[str, int] = {}
        for peer in list(b.peers):
            roles[peer.role] = roles.get(peer.role, 0) + 1
        for role, n in sorted(roles.items()):
            peers.add_metric([role], n)
        yield peers
        for name, help, hist in (
                ("rlbus_broker_put_ack_seconds", "From a PUT's arrival to its ACK (durable)", stats.put_ack),
                ("rlbus_broker_staleness", "Staleness (step - policy version) of delivered trajectories",
                 stats.staleness)):
            yield HistogramMetricFamily(name, help, buckets=hist.cumulative(), sum_value=hist.sum)


def serve_metrics(broker) -> None:
    """Start the broker's metrics sinks (Prometheus, when configured) with its state in them."""
    prometheus = start(broker.cfg, "broker").prometheus
    if prometheus is not None:
        prometheus.add(BrokerCollector(broker))

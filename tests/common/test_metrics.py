"""The one metrics sink: every canonical metrics line reaches the log and each registered sink."""

from __future__ import annotations

from structlog.testing import capture_logs

from rlbus.common import metrics


def test_emit_reaches_the_log_and_every_sink_and_a_failing_sink_stops_nothing():
    got = []

    def good(event, values):
        got.append((event, values))

    def broken(event, values):
        raise RuntimeError("disk full")

    metrics.add_sink(broken)
    metrics.add_sink(good)
    try:
        with capture_logs() as logs:
            metrics.emit("train_step", step=3, loss=0.5)
            metrics.emit("train_step", step=4, loss=0.25)
    finally:
        metrics.remove_sink(broken)
        metrics.remove_sink(good)
    assert got == [("train_step", {"step": 3, "loss": 0.5}), ("train_step", {"step": 4, "loss": 0.25})]
    assert [e["step"] for e in logs if e["event"] == "train_step"] == [3, 4]
    failures = [e for e in logs if e["event"] == "metrics_sink_failed"]
    assert len(failures) == 1 and "disk full" in failures[0]["error"]  # reported once, not every step

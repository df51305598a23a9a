"""The metrics sinks beyond the log line, each real: Prometheus over HTTP, TensorBoard event files; a sink that
cannot start is a warning."""

from __future__ import annotations

import importlib.util
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from rlbus.common import metrics, telemetry
from rlbus.common.config import load_config
from tests.conftest import free_port, ipv6_loopback

STEP = dict(step=3, new_version=4, loss=0.5, reward_mean=0.25, samples=8, tokens=80, tokens_per_s=100.0,
            step_s=2.0, wait_s=0.5, publish_s=0.1, staleness={"0": 6, "2": 2}, rejected={}, reward_std=None)


def _samples(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name if not s.labels else (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_prometheus_serves_the_events_of_its_process():
    prometheus = telemetry.Prometheus("127.0.0.1", 0)
    try:
        prometheus("train_step", STEP)
        prometheus("train_step", dict(STEP, step=4, loss=float("nan")))  # not a number: left as it was
        prometheus("explorer_batch", dict(policy_version=2, samples=4, tokens=40, rollout_s=0.3))
        got = _samples(prometheus.port)
    finally:
        prometheus.close()
    assert got["rlbus_trainer_step"] == 4 and got["rlbus_trainer_loss"] == 0.5
    assert got["rlbus_trainer_samples_total"] == 16 and got["rlbus_trainer_step_seconds_count"] == 2
    assert got[("rlbus_trainer_staleness_bucket", (("le", "0.0"),))] == 12
    assert got[("rlbus_trainer_staleness_bucket", (("le", "1.0"),))] == 12
    assert got[("rlbus_trainer_staleness_bucket", (("le", "2.0"),))] == 16
    assert got["rlbus_explorer_policy_version"] == 2 and got["rlbus_explorer_rollout_seconds_count"] == 1


def test_tensorboard_writes_step_scalars_readable_by_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = telemetry.TensorBoard(tmp_path)
    board("train_step", STEP)
    board("train_step", dict(STEP, step=4, loss=0.25))
    board("eval", dict(policy_version=5, accuracy=0.75, seconds=1.0))
    board("explorer_batch", dict(policy_version=5, samples=4))  # no step of its own: not written
    board.close()
    acc = EventAccumulator(str(tmp_path)).Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train_step/loss")] == [(3, 0.5), (4, 0.25)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == [(5, 0.75)]
    assert "train_step/staleness" not in acc.Tags()["scalars"] and "explorer_batch/samples" not in acc.Tags()["scalars"]


def test_a_sink_that_cannot_start_is_a_warning_and_the_others_start(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")  # where wandb is installed, it starts for real, offline
    busy = telemetry.Prometheus("127.0.0.1", 0)  # the configured port is taken
    cfg = load_config(None, [f"run.dir={tmp_path}", f"metrics.prometheus_port={busy.port}",
                             "metrics.wandb_project=rlbus-test"])
    try:
        with capture_logs() as logs:
            started = telemetry.start(cfg, "trainer")
            metrics.emit("train_step", **STEP)
        started.close()
    finally:
        busy.close()
    unavailable = {e["sink"] for e in logs if e["event"] == "metrics_sink_unavailable"}
    assert "prometheus" in unavailable and started.prometheus is None
    assert ("wandb" in unavailable) == (importlib.util.find_spec("wandb") is None)
    if "wandb" not in unavailable:  # W&B's offline record of the run holds the step's scalars
        record = next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
        assert b"train_step/loss" in record and b"rlbus-test" in record
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "trainer")).Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train_step/loss")] == [(3, 0.5)]
    assert not any(isinstance(s, (telemetry.Prometheus, telemetry.TensorBoard)) for s in metrics._sinks)


@ipv6_loopback
def test_prometheus_on_an_ipv6_address_logs_a_url_that_reaches_it(tmp_path):
    cfg = load_config(None, [f"run.dir={tmp_path}", "metrics.prometheus_host=::1",
                             f"metrics.prometheus_port={free_port()}"], environ={})
    with capture_logs() as logs:
        started = telemetry.start(cfg, "broker")
    try:
        url = next(e["url"] for e in logs if e["event"] == "metrics_serving")
        assert url == f"http://[::1]:{started.prometheus.port}/metrics"
        metrics.emit("train_step", **STEP)
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        assert "rlbus_trainer_step 3.0" in text
    finally:
        started.close()

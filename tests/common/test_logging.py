"""Logging: JSON lines off a terminal, a JSON file sink always, context bound per process."""

from __future__ import annotations

import io
import json

import structlog

from rlbus.common.logging import bind, setup_logging


def test_json_lines_with_bound_context_and_file_sink(tmp_path):
    out = io.StringIO()
    sink = tmp_path / "run" / "broker.jsonl"
    setup_logging("broker", "info", "auto", sink, stream=out, peer="b1")
    bind(policy_version=3)
    structlog.get_logger().info("batch_committed", step=7, trajectories=32)
    structlog.get_logger().debug("not_shown")
    line = json.loads(out.getvalue().strip())
    assert line["event"] == "batch_committed" and line["component"] == "broker" and line["peer"] == "b1"
    assert line["policy_version"] == 3 and line["step"] == 7 and line["level"] == "info"
    assert isinstance(line["ts"], float)
    assert json.loads(sink.read_text().strip()) == line


def test_console_view_still_writes_json_to_file(tmp_path):
    out = io.StringIO()
    sink = tmp_path / "c.jsonl"
    setup_logging("trainer", "info", "console", sink, stream=out)
    structlog.get_logger().info("step_done", step=1)
    assert "step_done" in out.getvalue() and not out.getvalue().lstrip().startswith("{")
    assert json.loads(sink.read_text())["event"] == "step_done"


def test_an_event_for_the_file_only_is_not_written_to_the_stream(tmp_path):
    """What a command also prints in its own words (`error: ...`) is not said twice on stderr."""
    out = io.StringIO()
    sink = tmp_path / "e.jsonl"
    setup_logging("explorer", "info", "auto", sink, stream=out)
    structlog.get_logger().error("explorer_failed", error="conflict: rollout.model differs", file_only=True)
    structlog.get_logger().info("after")
    assert [json.loads(line)["event"] for line in out.getvalue().splitlines()] == ["after"]
    logged = [json.loads(line) for line in sink.read_text().splitlines()]
    assert [e["event"] for e in logged] == ["explorer_failed", "after"] and "file_only" not in logged[0]
    setup_logging("explorer", "info", "auto", None, stream=out)  # no file: the event goes nowhere
    structlog.get_logger().error("explorer_failed", error="again", file_only=True)
    assert "again" not in out.getvalue()


def test_metrics_keep_significant_digits_not_decimal_places():
    from rlbus.common.logging import significant

    assert significant(1.5e-05) == 1.5e-05  # rounding to 5 places would log 2e-05
    assert significant(0.123456789) == 0.12346
    assert significant(123456.7) == 123460.0
    assert significant(7) == 7 and isinstance(significant(7), int)
    assert significant(float("nan")) != significant(float("nan"))  # NaN stays NaN, no exception

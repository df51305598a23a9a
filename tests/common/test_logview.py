"""`rlbus logs`: merged in time order, filtered, followed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rlbus.logview import Filter, parse_since, read_events, show
from tests.conftest import REPO


def write(path, *events):
    with open(path, "a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


@pytest.fixture
def run_dir(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    write(logs / "broker.jsonl", {"ts": 1.0, "level": "info", "event": "broker_ready", "component": "broker"},
          {"ts": 4.0, "level": "warning", "event": "bad_message", "component": "broker", "code": "malformed"})
    write(logs / "trainer.jsonl", {"ts": 2.0, "level": "info", "event": "train_step", "component": "trainer",
                                   "peer": "trainer", "step": 0, "step_s": 0.5, "wait_s": 0.1, "publish_s": 0.1},
          {"ts": 5.0, "level": "error", "event": "boom", "component": "trainer", "peer": "trainer"})
    write(logs / "explorer-0.jsonl", {"ts": 3.0, "level": "debug", "event": "explorer_batch",
                                      "component": "explorer", "peer": "explorer-0", "batch_index": 0,
                                      "rollout_s": 0.5})
    (logs / "explorer-0.jsonl").open("a").write('{"ts": 6.0, "event": "half a li')  # still being written
    return tmp_path


def test_merged_in_time_order(run_dir):
    assert [e["ts"] for e in read_events(run_dir)] == [1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("flt,events", [
    (Filter(components=("trainer",)), ["train_step", "boom"]),
    (Filter(peer="explorer-0"), ["explorer_batch"]),
    (Filter(level="warning"), ["bad_message", "boom"]),
    (Filter(grep="step|batch"), ["train_step", "explorer_batch"]),
    (Filter(since=3.5), ["bad_message", "boom"]),
])
def test_filters(run_dir, flt, events):
    import io

    buf = io.StringIO()
    show(run_dir, flt, as_json=True, out=buf)
    assert [json.loads(line)["event"] for line in buf.getvalue().splitlines()] == events


def test_readable_lines_and_since_parsing(run_dir):
    import io

    buf = io.StringIO()
    show(run_dir, Filter(components=("trainer",)), out=buf)
    first = buf.getvalue().splitlines()[0]
    assert "trainer/trainer" in first and "train_step" in first and "step=0" in first
    assert parse_since("15m", now=10_000) == 10_000 - 900
    with pytest.raises(ValueError, match="15m or 2h"):
        parse_since("yesterday")


@pytest.mark.parametrize("started", ["plainly", "with_sigint_ignored"])
def test_follow_prints_what_components_append(run_dir, started):
    # A script that starts a command with `&` (or a CI runner) hands it SIGINT ignored; Ctrl-C must still work.
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if started == "with_sigint_ignored" else None
    proc = subprocess.Popen([sys.executable, "-m", "rlbus.cli", "logs", str(run_dir), "--follow", "--json",
                             "--level", "info"], cwd=REPO, stdout=subprocess.PIPE, text=True, preexec_fn=ignore)
    try:
        seen = [json.loads(proc.stdout.readline())["event"] for _ in range(4)]
        assert seen == ["broker_ready", "train_step", "bad_message", "boom"]
        time.sleep(0.3)
        write(run_dir / "logs" / "trainer.jsonl", {"ts": 7.0, "level": "info", "event": "train_step", "step": 1})
        write(run_dir / "logs" / "explorer-1.jsonl", {"ts": 8.0, "level": "info", "event": "explorer_connected"})
        got = [json.loads(proc.stdout.readline()) for _ in range(2)]
        assert [(e["event"], e["component"]) for e in got] == [("train_step", "trainer"),
                                                              ("explorer_connected", "explorer-1")]
        (run_dir / "logs" / "explorer-0.jsonl").open("a").write('ne", "level": "info"}\n')  # the half line ends
        assert json.loads(proc.stdout.readline())["event"] == "half a line"
    finally:
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(10) == 0


def test_missing_run_dir_is_a_clear_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "rlbus.cli", "logs", str(tmp_path / "nope")], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 2 and "give a run directory" in done.stderr


@pytest.mark.parametrize("tool", ["timeline", "report", "trace"])
def test_an_output_the_tool_cannot_write_is_one_error_line(run_dir, tool):
    """`-o` naming a directory was an IsADirectoryError traceback."""
    done = subprocess.run([sys.executable, "-m", "rlbus.cli", tool, str(run_dir), "-o", str(run_dir)], cwd=REPO,
                          capture_output=True, text=True)
    assert (done.returncode, done.stderr.splitlines()) == (2, [f"error: [Errno 21] Is a directory: '{run_dir}'"])


def test_one_reader_for_every_tool(run_dir):
    from rlbus.logview import events, last_event

    trainer = run_dir / "logs" / "trainer.jsonl"
    write(trainer, {"ts": 6.0, "level": "info", "event": "note", "text": "mentions \"train_step\" in a field"})
    assert [e["step"] for e in events(trainer, "train_step")] == [0]  # by name, not by substring
    assert [e["event"] for e in events(trainer)] == ["train_step", "boom", "note"]
    assert events(run_dir / "logs" / "explorer-0.jsonl")[-1]["event"] == "explorer_batch"  # the half line waits
    assert last_event(trainer, "train_step")["step"] == 0
    assert last_event(run_dir / "logs" / "broker.jsonl", field="code")["event"] == "bad_message"
    assert events(run_dir / "logs" / "nope.jsonl", "x") == [] and last_event(run_dir / "nope.jsonl") is None


def test_captured_output_is_read_by_the_same_reader():
    from rlbus.logview import events_in_text

    text = ('{"ts": 1.0, "event": "component_started", "pid": 7}\n'
            'Traceback (most recent call last):\n'
            '{"ts": 2.0, "event": "note", "text": "component_started"}\n'
            '{"ts": 3.0, "event": "component_started", "pid": 8}')  # the last line, without its newline
    assert [e["pid"] for e in events_in_text(text, "component_started")] == [7, 8]
    assert [e["event"] for e in events_in_text(text)] == ["component_started", "note", "component_started"]
    assert "component" not in events_in_text(text)[0]  # nothing added that the process did not write


def test_lines_that_are_not_rlbus_events_are_shown_unparsed_and_never_break_a_tool(run_dir):
    """A log damaged by hand or by a disk (text, other JSON, a `ts` that is not a time, a level that is not a
    string, bytes that are not UTF-8, JSON nested past the parser) is shown line by line as `unparsed_line`, at
    the time of the line before it; `rlbus logs`, `--since` and the tools that read every event go on."""
    import io

    bad = ['not json', '{"event": "x", "ts": "soon"}', '{"ts": 1e300, "event": "far"}', '{"ts": true}',
           '{"level": ["x"], "ts": 3}', '{"component": 5, "ts": 4}', '[1, 2]', '\x00\udcff', '[' * 100_000]
    with open(run_dir / "logs" / "trainer.jsonl", "a", encoding="utf-8", errors="surrogateescape") as f:
        f.write("".join(line + "\n" for line in bad))
    for flt in (Filter(), Filter(since=3.5), Filter(since=5.5)):
        buf = io.StringIO()
        show(run_dir, flt, out=buf)
        assert buf.getvalue().count("unparsed_line") == (len(bad) if flt.since < 5 else 0)
    assert [e["ts"] for e in read_events(run_dir)] == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_an_event_without_the_numbers_a_tool_draws_it_by_is_left_out_of_the_run_tools(run_dir, tmp_path):
    """A `train_step` without its times, or with one that is no number (a line of another rlbus version, or one
    edited by hand), failed `rlbus timeline`, `report` and `trace` with a KeyError; `rlbus logs` shows it."""
    from rlbus import report, timeline, trace

    bad = [{"ts": 2.5, "event": "train_step", "component": "trainer", "step": 1},
           {"ts": 2.6, "event": "train_step", "component": "trainer", "step": 2, "step_s": "1", "wait_s": 0.1,
            "publish_s": 0.1},
           {"ts": 2.7, "event": "explorer_batch", "component": "explorer", "rollout_s": float("nan")},
           {"ts": 2.8, "event": "eval", "component": "explorer", "policy_version": 1, "seconds": 1.0}]
    with open(run_dir / "logs" / "trainer.jsonl", "a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in bad))
    assert [e["ts"] for e in read_events(run_dir)] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert len(timeline.render(run_dir, tmp_path / "t.png")) == 4  # the good step's three spans, one rollout
    assert trace.write(run_dir, tmp_path / "t.json") > 0
    report.write(run_dir, tmp_path / "r.html")
    assert "<svg" in (tmp_path / "r.html").read_text()


def test_a_peer_without_a_name_logs_events_like_any_other(run_dir):
    """`rlbus reward` or `rlbus explorer` started without --name binds peer None: its lines are events."""
    import io

    write(run_dir / "logs" / "reward.jsonl", {"ts": 4.5, "level": "info", "event": "reward_ready",
                                              "component": "reward", "peer": None},
          {"ts": 4.6, "level": None, "event": "odd", "component": None})
    assert [e["event"] for e in read_events(run_dir) if 4 < e["ts"] < 5] == ["reward_ready", "odd"]
    buf = io.StringIO()
    show(run_dir, Filter(), out=buf)
    assert "reward                 info    reward_ready" in buf.getvalue() and "unparsed_line" not in buf.getvalue()


def test_a_grep_that_is_not_a_regular_expression_is_a_clear_error():
    with pytest.raises(ValueError, match=r"--grep '\(' is not a regular expression: missing \)"):
        Filter(grep="(")


def test_a_line_that_is_no_event_stays_where_it_was_written(run_dir):
    """A traceback's line in a component's log is merged and filtered at the time of the line before it, not at
    the epoch: it follows the event it came after, and `--since` keeps it with that event."""
    import io

    (run_dir / "logs" / "broker.jsonl").open("a").write("Traceback (most recent call last):\n")
    for flt, want in ((Filter(), ["broker_ready", "train_step", "explorer_batch", "bad_message", "unparsed_line",
                                  "boom"]),
                      (Filter(since=3.5), ["bad_message", "unparsed_line", "boom"])):
        buf = io.StringIO()
        show(run_dir, flt, as_json=True, out=buf)
        assert [json.loads(line)["event"] for line in buf.getvalue().splitlines()] == want
    buf = io.StringIO()
    show(run_dir, Filter(components=("broker",)), out=buf)
    warning, traceback = buf.getvalue().splitlines()[-2:]
    assert traceback[:12] == warning[:12] and "unparsed_line text=Traceback" in traceback


def test_a_last_line_without_its_newline_is_read_when_it_is_a_whole_event(run_dir):
    """A component stopped between an event and its newline: the event is read (by `rlbus logs` and every tool);
    a line cut short is still left for the next read."""
    import io

    (run_dir / "logs" / "trainer.jsonl").open("a").write('{"ts": 6.0, "level": "error", "event": "last_words"}')
    from rlbus.logview import events

    assert [e["event"] for e in events(run_dir / "logs" / "trainer.jsonl")][-1] == "last_words"
    buf = io.StringIO()
    show(run_dir, Filter(level="error"), as_json=True, out=buf)
    assert [json.loads(line)["event"] for line in buf.getvalue().splitlines()] == ["boom", "last_words"]
    assert "half a li" not in buf.getvalue()

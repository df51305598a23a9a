"""`rlbus logs RUN_DIR`: the components' JSON logs, merged in time order and shown readably.

Every component of a run writes JSON lines to `RUN_DIR/logs/<component>.jsonl`
(each line has `ts`, `level`, `event`, `component` and its fields). This
merges them by `ts`, filters (component, peer, minimum level, a regular
expression, a start time), and prints either a readable line per event or
the raw JSON. With `follow` it then keeps printing what the components
append, files created later included, until interrupted.
"""

from __future__ import annotations

import heapq
import json
import re
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Iterable, Iterator, TextIO

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_FIXED = ("ts", "level", "event", "component", "peer")


@dataclass
class Filter:
    components: tuple[str, ...] = ()
    peer: str = ""
    level: str = "debug"
    grep: str = ""
    since: float = 0.0

    def __post_init__(self) -> None:
        try:
            self._grep = re.compile(self.grep) if self.grep else None
        except re.error as exc:
            raise ValueError(f"--grep {self.grep!r} is not a regular expression: {exc}") from None

    def keep(self, event: dict, raw: str, ts: float) -> bool:
        """`ts`: the event's time, or for a line without one the time of the line before it."""
        if self.components and event.get("component") not in self.components:
            return False
        if self.peer and event.get("peer") != self.peer:
            return False
        if LEVELS.get(event.get("level", "info"), 20) < LEVELS[self.level]:
            return False
        if ts < self.since:
            return False
        return not self._grep or bool(self._grep.search(raw))


def parse_since(text: str, now: float | None = None) -> float:
    """`90s`, `15m`, `2h` ago, or an ISO time (`2026-11-22T05:00:00`, local time) -> Unix seconds."""
    now = time.time() if now is None else now
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if match:
        return now - float(match[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(f"--since {text!r}: use a duration like 15m or 2h, or an ISO time") from None


def _events(path: Path, start: int = 0, ts: float = 0.0) -> Iterator[tuple[float, dict, str, int]]:
    """(ts, event, raw line, offset after it) for every complete line from byte `start` (`ts`: the time of the
    line before it)."""
    with open(path, "rb") as f:
        f.seek(start)
        yield from _events_in(f, path.stem, offset=start, ts=ts)


def events(path: str | Path, name: str | None = None) -> list[dict]:
    """The events of one component's log (`name`: only those of that event), in the order written.

    The one reader of rlbus's JSON-lines logs: the launcher, `rlbus logs`, the timeline, the benchmarks
    and the tests all read through it. A missing file has no events; a line still being written is left
    for the next read.
    """
    path = Path(path)
    if not path.exists():
        return []
    needle = f'"{name}"'.encode() if name else b""
    with open(path, "rb") as f:
        raw = f.read()
    return [e for _, e, line, _ in _events_in(raw.splitlines(keepends=True), path.stem, needle)
            if name is None or e.get("event") == name]


def events_in_text(text: str, name: str | None = None) -> list[dict]:
    """The events in captured JSON-lines output (a process's stderr), like `events` for a file; lines that are
    not JSON objects (a traceback, a warning printed by a library) are skipped."""
    lines = (text if text.endswith("\n") else text + "\n").encode().splitlines(keepends=True)
    return [e for _, e, _, _ in _events_in(lines, "") if e.get("event") != "unparsed_line"
            and (name is None or e.get("event") == name)]


def last_event(path: str | Path, name: str | None = None, field: str | None = None,
               tail_bytes: int = 65536) -> dict | None:
    """The newest event of a log named `name` (or carrying `field`), from the last `tail_bytes` of the file."""
    path = Path(path)
    if not path.exists():
        return None
    with open(path, "rb") as f:
        start = max(0, f.seek(0, 2) - tail_bytes)
        f.seek(start)
        lines = f.read().splitlines(keepends=True)[1 if start else 0:]  # from mid-line: skip to the next
    for _, e, _, _ in reversed(list(_events_in(lines, path.stem))):
        if (name is None or e.get("event") == name) and (field is None or field in e):
            return e
    return None


def _events_in(lines: Iterable[bytes], stem: str, needle: bytes = b"", offset: int = 0, ts: float = 0.0
               ) -> Iterator[tuple[float, dict, str, int]]:
    """(ts, event, line, offset after it) for every complete line; lines without `needle` are skipped unparsed
    (a cheap pre-filter for readers after one event name). A last line without its newline is complete when it
    is a whole event (the writer stopped before the newline); otherwise it is still being written, and is read
    next time. A line that is no event, or an event without `ts`, takes the time of the line before it: it
    stays where it was written when logs are merged and filtered by time."""
    for raw in lines:
        complete = raw.endswith(b"\n")
        if complete and needle and needle not in raw:
            offset += len(raw)
            continue
        line = raw.decode("utf-8", "replace").strip()
        try:
            event = json.loads(line) if line else None
        except (json.JSONDecodeError, RecursionError):
            event = None
        whole = _is_event(event)
        if not complete and not whole:
            break
        offset += len(raw)
        if not line or needle not in raw:  # (an empty needle is in every line)
            continue
        if not whole:
            event = {"event": "unparsed_line", "ts": ts, "text": line[:500]}
        ts = float(event.get("ts", ts))
        if stem:
            event.setdefault("component", stem)
        yield ts, event, line, offset


def _is_event(event) -> bool:
    """A log line as rlbus writes them: a JSON object whose `ts` (if any) is a time and whose level, event,
    component and peer (if any) are strings or null (a peer without a name). Anything else is shown as
    `unparsed_line`, never trusted."""
    if not isinstance(event, dict):
        return False
    ts = event.get("ts", 0.0)
    if type(ts) not in (int, float) or not 0 <= ts < 1e11:  # NaN fails too; 1e11 s is the year 5138
        return False
    return all(isinstance(event.get(k), (str, type(None))) for k in ("level", "event", "component", "peer"))


def format_event(event: dict) -> str:
    ts = datetime.fromtimestamp(float(event["ts"])).strftime("%H:%M:%S.%f")[:-3] if "ts" in event else " " * 12
    who = (event.get("component") or "?") + (f"/{event['peer']}" if event.get("peer") else "")
    fields = " ".join(f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}"
                      for k, v in event.items() if k not in _FIXED)
    return f"{ts} {who:<22} {event.get('level') or 'info':<7} {event.get('event') or ''} {fields}".rstrip()


def _emit(out: TextIO, event: dict, as_json: bool) -> None:
    # JSON mode prints the event as logged, with `component` filled in from the file name where missing.
    out.write((json.dumps(event) if as_json else format_event(event)) + "\n")


def show(run_dir: str | Path, flt: Filter, as_json: bool = False, follow: bool = False, out: TextIO | None = None,
         poll_s: float = 0.2, until: float | None = None) -> int:
    """Print the merged logs; with `follow`, keep going until interrupted (or `until`). Returns events shown."""
    import sys

    out = out or sys.stdout
    logs = Path(run_dir) / "logs"
    if not logs.is_dir():
        raise FileNotFoundError(f"{logs} does not exist: give a run directory (one `rlbus up` made)")
    offsets: dict[Path, tuple[int, float]] = {}  # where a log was read to, and the time of its last line
    streams = []
    for path in sorted(logs.glob("*.jsonl")):
        events = list(_events(path))
        offsets[path] = (events[-1][3], events[-1][0]) if events else (0, 0.0)
        streams.append([(ts, i, path.stem, ev, raw) for i, (ts, ev, raw, _) in enumerate(events)])
    shown = 0
    for ts, _, _, event, raw in heapq.merge(*streams, key=lambda e: (e[0], e[2], e[1])):
        if flt.keep(event, raw, ts):
            _emit(out, event, as_json)
            shown += 1
    out.flush()
    while follow and (until is None or time.time() < until):
        time.sleep(poll_s)
        fresh: list[tuple[float, dict, str]] = []
        for path in sorted(logs.glob("*.jsonl")):
            for ts, event, raw, offset in _events(path, *offsets.get(path, (0, 0.0))):
                fresh.append((ts, event, raw))
                offsets[path] = (offset, ts)
        for ts, event, raw in sorted(fresh, key=lambda e: e[0]):
            if flt.keep(event, raw, ts):
                _emit(out, event, as_json)
                shown += 1
        out.flush()
    return shown


# The numbers the run tools (timeline, report, trace) read from the events they draw.
DRAWN = {"train_step": ("step", "step_s", "wait_s", "publish_s"), "explorer_batch": ("rollout_s",),
         "explorer_groups": ("rollout_s",), "put_acked": ("seconds",), "weights_loaded": ("seconds", "policy_version"),
         "weights_wait_over": ("need_version",), "eval": ("seconds", "policy_version", "accuracy"),
         "explorer_activity": ("idle_share",), "weights_published": ("policy_version",)}


def _drawable(e: dict) -> bool:
    return all(type(e.get(k)) in (int, float) and e[k] == e[k] for k in DRAWN.get(e["event"], ()))


def read_events(run_dir: str | Path, components: Iterable[str] = ()) -> list[dict]:
    """Every event of a run, merged by time (for tools such as the timeline): lines that are not events of
    rlbus's (no `ts` or `event`, or not JSON at all) left out, and so are events the tools draw without the
    numbers they draw them by (a line of another rlbus version, or one edited by hand)."""
    import io

    buf = io.StringIO()
    show(run_dir, Filter(tuple(components)), as_json=True, out=buf)
    events = (json.loads(line) for line in buf.getvalue().splitlines() if line.startswith("{"))
    return [e for e in events if "ts" in e and e.get("event", "unparsed_line") != "unparsed_line" and _drawable(e)]

"""Structured logging for every rlbus process, configured in one place.

Entrypoints call `setup_logging` once; library code only calls
`structlog.get_logger()` and binds context. Output is JSON lines when stderr
is not a terminal (containers, `rlbus up` child processes) and a readable
console view when it is; an optional file sink always gets JSON lines, which
`rlbus logs` and `rlbus timeline` read back. Event names are snake_case and
values go in fields, never into the event string.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _Quiet:
    """A stream whose writes never raise: a closed terminal (EIO) or a gone reader (EPIPE) must not stop a
    process in the middle of stopping cleanly. After the first failure, writes are dropped. Without a stream
    of its own it writes to whatever `sys.stderr` is at the time (a live terminal view redirects it, and
    prints the lines above itself)."""

    def __init__(self, stream: TextIO | None):
        self._own = stream
        self._broken = False

    @property
    def _stream(self) -> TextIO:
        return self._own or sys.stderr

    def write(self, text: str) -> int:
        if not self._broken:
            try:
                return self._stream.write(text)
            except (OSError, ValueError):  # ValueError: the stream was closed
                self._broken = True
        return len(text)

    def flush(self) -> None:
        if not self._broken:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self._broken = True


class _Tee:
    """Render each event once for the stream and once, as JSON, for the file; an event logged with
    `file_only=True` goes to the file alone (what the process also prints in its own words, as `error: ...`)."""

    def __init__(self, stream: TextIO, console: bool, file: TextIO | None):
        self._stream = stream
        self._file = file
        self._json = structlog.processors.JSONRenderer()
        self._console = structlog.dev.ConsoleRenderer(colors=stream.isatty()) if console else None

    def __call__(self, logger: Any, name: str, event: dict) -> str:
        file_only = event.pop("file_only", False)
        line = self._json(logger, name, dict(event))
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()
        if file_only:
            raise structlog.DropEvent
        if self._console is not None:
            return self._console(logger, name, event)
        return line


def setup_logging(component: str, level: str = "info", fmt: str = "auto", file: str | Path | None = None,
                  stream: TextIO | None = None, **context: Any) -> structlog.stdlib.BoundLogger:
    """Configure structlog for this process and bind `component` and `context`."""
    own, stream = stream, stream or sys.stderr
    console = fmt == "console" or (fmt == "auto" and stream.isatty())
    sink = None
    if file:
        Path(file).parent.mkdir(parents=True, exist_ok=True)
        sink = open(file, "a", buffering=1, encoding="utf-8")
    structlog.reset_defaults()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _timestamp,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            _Tee(stream, console, sink),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(_Quiet(own)),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(component=component, **context)
    return structlog.get_logger()


def _timestamp(_: Any, __: str, event: dict) -> dict:
    # Unix seconds as a float: exact for merging logs of several processes in
    # time order, and for timelines; `rlbus logs` shows it readably.
    event["ts"] = round(time.time(), 6)
    return event


def bind(**context: Any) -> None:
    """Bind context (peer, policy_version, step) for every later event of this process."""
    structlog.contextvars.bind_contextvars(**context)


def significant(value: float | int, digits: int = 5) -> float | int:
    """A metric for a log line: `digits` significant digits (an lr of 1.5e-05 stays 1.5e-05; rounding to
    decimal places would make it 2e-05); integers as they are."""
    if isinstance(value, int) or value != value or value in (float("inf"), float("-inf")):
        return value
    return float(f"{value:.{digits}g}")

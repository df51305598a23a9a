"""Live progress on a terminal (rich), for `rlbus up` and `rlbus model prepare`.

Only where stderr is a terminal and the logs are not asked for as JSON: there
the view replaces the periodic progress lines. Elsewhere nothing changes, and
the JSON lines stay exactly as they are.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def wanted(log_format: str, stream: TextIO | None = None) -> bool:
    """Whether to show a live view: a terminal, and logs not forced to JSON."""
    stream = stream or sys.stderr
    return log_format != "json" and stream.isatty()


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _num(value: Any, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


class RunView:
    """`rlbus up` on a terminal: step out of total, reward, held-out accuracy, each explorer's policy version,
    the buffer's depth, elapsed time and an ETA from the pace of the steps so far."""

    def __init__(self, total_steps: int, console=None):
        from rich.console import Console
        from rich.live import Live

        self.total = total_steps
        self.console = console or Console(stderr=True)
        self.live = Live(console=self.console, refresh_per_second=2, transient=False)
        self.started = time.monotonic()
        self._first: tuple[float, int] | None = None  # (when, step) the first step was seen
        self._reward = None  # the last step with a reward (a step of all-equal groups trains nothing, has none)

    def __enter__(self) -> RunView:
        self.live.start()
        return self

    def __exit__(self, *exc) -> None:
        self.live.stop()

    def eta(self, step: int | None, now: float) -> float | None:
        if step is None:
            return None
        if self._first is None:
            self._first = (now, step)
            return None
        at, first = self._first
        done = step - first
        return (now - at) / done * (self.total - 1 - step) if done > 0 else None

    def render(self, progress: dict[str, Any], now: float | None = None):
        from rich.table import Table

        now = time.monotonic() if now is None else now
        step = progress.get("step")
        table = Table(title="rlbus up", title_justify="left", show_header=False, box=None, padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        done = 0 if step is None else step + 1
        table.add_row("step", f"{done}/{self.total}")
        if progress.get("reward_mean") is not None:
            self._reward = progress["reward_mean"]
        table.add_row("reward", _num(self._reward))
        accuracy = progress.get("accuracy")
        table.add_row("held-out accuracy", "–" if accuracy is None else
                      f"{accuracy:.3f} (v{progress.get('accuracy_version')})")
        versions = progress.get("explorer_versions") or {}
        table.add_row("explorers", "  ".join(f"{name} v{_num(v)}" for name, v in versions.items()) or "none")
        table.add_row("buffer depth", _num(progress.get("buffer_depth")))
        table.add_row("elapsed", _clock(now - self.started))
        table.add_row("ETA", _clock(self.eta(step, now)))
        return table

    def update(self, progress: dict[str, Any]) -> None:
        self.live.update(self.render(progress))


class Phases:
    """A spinner with the current phase and its elapsed time (`rlbus model prepare` on a terminal)."""

    def __init__(self, what: str, console=None):
        from rich.console import Console

        self.what = what
        self.console = console or Console(stderr=True)
        self._status = None
        self._phase = ""
        self._since = time.monotonic()

    def _done(self) -> None:
        if self._phase:
            self.console.log(f"{self.what}: {self._phase} took {time.monotonic() - self._since:.1f} s")

    def __call__(self, phase: str) -> None:
        self._done()
        if self._status is None:
            self._status = self.console.status(f"{self.what}: {phase}")
            self._status.start()
        else:
            self._status.update(f"{self.what}: {phase}")
        self._phase, self._since = phase, time.monotonic()

    def close(self) -> None:
        if self._status is not None:
            self._done()
            self._status.stop()
            self._status = None

"""The one sink for per-step metrics.

Every canonical metrics line goes through `emit`: the trainer's
`train_step` and `weights_published`, the explorer's `explorer_batch`, `explorer_groups`,
`weights_loaded`, `put_acked` and `eval`. The first record is the structured
log line (JSON lines that `rlbus logs`, the launcher's run summary and the
benchmarks read back through `rlbus.logview`); further sinks (Prometheus,
TensorBoard, W&B: `rlbus.common.telemetry`) register with `add_sink` and
receive the same event name and values. A sink that fails is reported once per event name and
never stops the process.
"""

from __future__ import annotations

from typing import Any, Callable

import structlog

Sink = Callable[[str, dict[str, Any]], None]

log = structlog.get_logger()
_sinks: list[Sink] = []
_failed: set[tuple[int, str]] = set()


def add_sink(sink: Sink) -> None:
    _sinks.append(sink)


def remove_sink(sink: Sink) -> None:
    if sink in _sinks:
        _sinks.remove(sink)


def emit(event: str, **values: Any) -> None:
    """Record one metrics event: the log line, then every registered sink."""
    log.info(event, **values)
    for sink in list(_sinks):
        try:
            sink(event, values)
        except Exception as exc:
            key = (id(sink), event)
            if key not in _failed:
                _failed.add(key)
                log.warning("metrics_sink_failed", sink=getattr(sink, "__name__", repr(sink)), metrics_event=event,
                            error=f"{type(exc).__name__}: {exc}"[:300])

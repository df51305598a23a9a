"""How busy an explorer's engine is, logged as `explorer_activity`."""

from __future__ import annotations

import time

from rlbus.common import metrics

ACTIVITY_EVERY_S = 5.0  # how often `explorer_activity` is logged


class Activity:
    """The engine's busy share, logged every ACTIVITY_EVERY_S as `explorer_activity` (cumulative seconds, so a
    reader takes any window's share from two lines): `busy_s` in engine steps, `paused_s` in weight loads,
    `held_s` with nothing to do because the broker said WAIT (admission: too far ahead of the trainer, or
    waiting for a version), `idle_share` = 1 - busy / wall, `sequences_mean` the sequences being generated,
    on average over wall time."""

    def __init__(self, engine):
        self.engine = engine
        self.started = time.monotonic()
        # warm-up and earlier runs are not counted
        self.busy0, self.paused0, self.sequence0 = engine.busy_s, engine.paused_s, engine.sequence_s
        self.held_s = 0.0

    def tick(self, in_flight: int) -> None:
        if time.monotonic() - getattr(self, "_emitted", self.started) >= ACTIVITY_EVERY_S:
            self.emit(in_flight)

    def emit(self, in_flight: int) -> None:
        now = time.monotonic()
        self._emitted = now
        wall = now - self.started
        busy = self.engine.busy_s - self.busy0
        metrics.emit("explorer_activity", wall_s=round(wall, 3), busy_s=round(busy, 3),
                     paused_s=round(self.engine.paused_s - self.paused0, 3), held_s=round(self.held_s, 3),
                     idle_share=round(1 - busy / wall, 4) if wall else 0.0,
                     sequences_mean=round((self.engine.sequence_s - self.sequence0) / wall, 2) if wall else 0.0,
                     in_flight=in_flight)

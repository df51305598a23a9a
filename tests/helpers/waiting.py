"""Waiting in tests for something another process or thread does."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float, what: str) -> None:
    """Return once `predicate()` holds; fail the test, naming `what`, if it does not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")

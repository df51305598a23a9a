"""Rolling weight updates: at most `sync.max_swapping` explorers swap weights at once.

A streaming explorer asks for a slot (`SWAP {phase: begin}`) before it
pauses its engine to load a new version and gives it back (`SWAP {phase:
end}`) once generation resumes, so the fleet never stops generating
together. A slot is freed as well when its holder leaves or is dropped, and
when it has held the slot for `sync.swap_timeout_s`.
"""

from __future__ import annotations

from typing import Any

import structlog

from rlbus.common import protocol as P

log = structlog.get_logger()


class SwapSlots:
    def __init__(self, limit: int, timeout_s: float):
        self.limit = limit
        self.timeout_s = timeout_s
        self.holders: dict[str, tuple[int, float]] = {}  # explorer name -> (version, granted at)

    def answer(self, name: str, header: dict[str, Any], now: float, retry_after_s: float) -> tuple[str, dict]:
        """The reply to a SWAP: OK, or WAIT while every slot is taken."""
        if header["phase"] == "end":
            self.end(name, now)
        elif not self.begin(name, header["version"], now):
            return P.WAIT, {"reason": "swapping", "retry_after_s": retry_after_s, "swapping": sorted(self.holders)}
        return P.OK, {}

    def begin(self, name: str, version: int, now: float) -> bool:
        """Grant `name` a slot (again, if it holds one: a resent request); False when all are taken."""
        if name not in self.holders:
            if self.limit and len(self.holders) >= self.limit:
                return False
            log.info("swap_granted", peer=name, policy_version=version, swapping=len(self.holders) + 1)
        self.holders[name] = (version, self.holders.get(name, (version, now))[1])
        return True

    def end(self, name: str, now: float, reason: str = "done") -> None:
        held = self.holders.pop(name, None)
        if held is not None:
            log.info("swap_released", peer=name, policy_version=held[0], reason=reason,
                     held_s=round(now - held[1], 3), swapping=len(self.holders))

    def expire(self, now: float) -> None:
        for name, (_, granted) in list(self.holders.items()):
            if now - granted > self.timeout_s:
                self.end(name, now, "timeout")

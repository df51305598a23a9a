"""The run's rollout settings, as WELCOME gives them and every HELLO is checked against.

`rollout.dtype: auto` leaves the dtype to the hosts: each explorer and trainer
resolves it on its own (`rlbus.weights.models.rollout_dtype`) and reports the
result in HELLO. The first peer to report one pins it for the run (kept in the
store, so a restarted broker keeps it); a peer that resolved to another is
refused like any other difference, with the field named.
"""

from __future__ import annotations

from typing import Any

import structlog

from rlbus.broker.store import Store
from rlbus.common.config import RunConfig
from rlbus.common.messages import Rollout, fields

log = structlog.get_logger()

FIELDS = fields(Rollout)
_PINNED = "rollout_dtype"  # the store's meta key


class RunRollout:
    def __init__(self, cfg: RunConfig, store: Store):
        self.store = store
        self.settings: dict[str, Any] = cfg.rollout.model_dump()
        if self.settings["dtype"] == "auto":
            self.settings["dtype"] = store.get_meta(_PINNED, "auto")

    def differences(self, given: dict[str, Any]) -> list[str]:
        """What a peer's own settings say otherwise than the run's, one line per field (none: it may join)."""
        out = []
        for key, value in given.items():
            run = self.settings.get(key)
            if key not in FIELDS or value == run:
                continue
            if not (key == "dtype" and "auto" in (value, run)):
                out.append(f"rollout.{key}: this peer has {value!r}, the run {run!r}")
        return out

    def admit(self, given: dict[str, Any], peer: str) -> None:
        """A peer without differences joins: the first resolved dtype of an `auto` run becomes the run's.

        The pin is recorded first: a disk error raised here leaves the run unpinned."""
        dtype = given.get("dtype", "auto")
        if self.settings["dtype"] == "auto" and dtype != "auto":
            self.store.set_meta(_PINNED, dtype)
            self.settings["dtype"] = dtype
            log.info("rollout_dtype_pinned", dtype=dtype, peer=peer)

"""The run's rollout settings, as WELCOME gives them and every HELLO is checked against.

Two fields may be left open and are then fixed by the first peer that reports them, kept in the catalogue so
that a restarted broker keeps them; a peer that reports another value later is refused like any other
difference, with the field named:
- `dtype`, when the run's is `auto`: each explorer and trainer resolves it on its own host
  (`rlbus.weights.models.rollout_dtype`);
- `model`, always: no config setting gives it; each peer reads it from its model's files
  (`rlbus.weights.models.model_fingerprint`), so every process of the run samples and trains one model.
"""

from __future__ import annotations

from typing import Any

import structlog

from rlbus.broker.catalog import Catalog
from rlbus.common.config import RunConfig
from rlbus.common.messages import Rollout, fields

log = structlog.get_logger()

FIELDS = fields(Rollout)
OPEN = {"dtype": "auto", "model": ""}  # field -> the value that leaves it open
_REMEDY = {"model": "start it with the run's model (model.path), or use a new run directory for another model"}


def _pin_key(field: str) -> str:
    return f"rollout_{field}"  # the catalogue's meta key


class RunRollout:
    def __init__(self, cfg: RunConfig, catalog: Catalog):
        self.catalog = catalog
        self.settings: dict[str, Any] = {**cfg.rollout.model_dump(), "model": ""}
        for field, unset in OPEN.items():
            if self.settings[field] == unset:
                self.settings[field] = catalog.get_meta(_pin_key(field), unset)

    def differences(self, given: dict[str, Any]) -> dict[str, str]:
        """What a peer's own settings say otherwise than the run's: field -> the line that says so (none: it may
        join)."""
        out = {}
        for key, value in given.items():
            run = self.settings.get(key)
            if key not in FIELDS or value == run or (key in OPEN and OPEN[key] in (value, run)):
                continue
            out[key] = f"rollout.{key}: this peer has {value!r}, the run {run!r}"
        return out

    def refusal(self, given: dict[str, Any]) -> str | None:
        """Why a peer with these settings may not join (the message of its `conflict`), or None."""
        differs = self.differences(given)
        if not differs:
            return None
        remedies = [_REMEDY[k] for k in differs if k in _REMEDY]
        if len(remedies) < len(differs):
            remedies.append("start it with the run's rollout settings, or leave them out to take the run's")
        return f"{'; '.join(differs.values())}: {'; '.join(remedies)}"

    def admit(self, given: dict[str, Any], peer: str) -> None:
        """A peer without differences joins: the open fields it reports become the run's.

        The pins are recorded first, together: a disk error raised here leaves the run as it was."""
        pins = {k: given[k] for k, unset in OPEN.items() if self.settings[k] == unset and given.get(k, unset) != unset}
        if not pins:
            return
        with self.catalog.transaction():
            for field, value in pins.items():
                self.catalog.set_meta(_pin_key(field), value)
        for field, value in pins.items():
            self.settings[field] = value
            log.info(f"rollout_{field}_pinned", **{field: value}, peer=peer)

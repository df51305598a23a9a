"""Weight sync behind one interface: a sender in the trainer, a receiver in each explorer, one pair per method.

Sender (trainer): `attach(client)` once connected, `snapshot(model)` on the
training thread (one copy, so training goes on), `publish(snapshot, version,
step)` on the publishing thread (returns the weight state for PUBLISH),
`close()`. `make_sender` picks the pair by `sync.sync_method`:

    checkpoint   CheckpointSender (checkpoint.py)   weights/v{N}/ on disk, read by path
    nccl         BroadcastSender  (broadcaster.py)  a broadcast to the epoch's members, plus the checkpoint

Receiver (explorer): `Receiver.load(engine, state)` brings the engine to the
announced version with one call. It chooses a *source*: the broadcast when
this explorer is a member of the announced epoch (and did not fail that
version), else the checkpoint, whose digest it checks first. A source is a
small picklable map; the engine hands it to its workers, where
`open_source` turns it into an iterator of (name, tensor) that the engine
reloads from. The engine knows nothing else about weight sync.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Protocol

import structlog

from rlbus.weights.digest import matches

log = structlog.get_logger()


class DigestMismatch(Exception):
    """Weights on disk are not the ones the bus announced."""


class Sender(Protocol):
    method: str

    def attach(self, client) -> None: ...
    def snapshot(self, model) -> Any: ...
    def publish(self, snapshot: Any, version: int, step: int) -> dict[str, Any]: ...
    def close(self) -> None: ...


class Engine(Protocol):
    """What a receiver needs of an engine: its version, and a reload from a source."""

    version: int

    def reload(self, source: dict[str, Any], version: int) -> dict[str, Any]: ...


def make_sender(cfg, weights_dir: str | Path, base_model_dir: str | Path, device: str = "cpu") -> Sender:
    """The trainer's sender for `cfg.sync.sync_method`, publishing in `cfg.rollout.dtype`."""
    import torch

    from rlbus.weights.checkpoint import CheckpointSender

    dtype = getattr(torch, cfg.rollout.dtype)
    checkpoint = CheckpointSender(weights_dir, base_model_dir, dtype=dtype)
    if cfg.sync.sync_method == "nccl":
        from rlbus.weights.broadcaster import BroadcastSender

        return BroadcastSender(cfg, checkpoint, dtype=dtype, device=device)
    return checkpoint


def checkpoint_source(path: str | Path) -> dict[str, Any]:
    return {"method": "checkpoint", "path": str(path)}


def broadcast_source(announcement: dict[str, Any], rank: int) -> dict[str, Any]:
    return {"method": "nccl", "announcement": announcement, "rank": rank}


def load_checkpoint(engine: Engine, path: str | Path, digest: str, version: int) -> dict[str, Any]:
    """Load published weights by path into the engine, after checking their digest."""
    if digest:
        ok, actual = matches(path, digest)
        if not ok:
            raise DigestMismatch(f"weights at {path} have digest {actual}, the bus announced {digest}")
    return engine.reload(checkpoint_source(path), version)


class Receiver:
    """An explorer's side of weight sync, for any method (see the module docstring)."""

    def __init__(self, name: str):
        self.name = name
        self.failed: set[int] = set()  # versions whose broadcast failed here: they come by checkpoint

    def load(self, engine: Engine, state: dict[str, Any] | None) -> bool:
        """Bring `engine` to the version of the weight state `state`; True if it loaded it."""
        if not state or state["version"] <= engine.version:
            return False
        ann = state.get("broadcast")
        if ann and self.name in ann["ranks"] and ann["version"] not in self.failed:
            try:
                engine.reload(broadcast_source(ann, ann["ranks"][self.name]), ann["version"])
                return True
            except Exception as exc:  # the trainer aborts the epoch; this version comes by checkpoint
                self.failed.add(ann["version"])
                log.warning("broadcast_failed", policy_version=ann["version"], epoch=ann["epoch"],
                            error=str(exc)[:300])
        if not state.get("location"):
            return False  # announced by broadcast only so far: its checkpoint follows
        try:
            load_checkpoint(engine, state["location"], state["digest"], state["version"])
        except (DigestMismatch, FileNotFoundError) as exc:
            log.error("weights_load_failed", policy_version=state["version"], error=str(exc))
            return False
        return True


def open_source(source: dict[str, Any], worker: Any) -> tuple[Iterator[tuple[str, Any]], dict[str, Any]]:
    """Inside an engine worker: the tensors of `source`, and a map the opener fills with what it measured.

    A broadcast member keeps its place in the epoch on `worker` between versions (see
    `broadcast.receive_version`); the tensors it returns are views of the received buckets, checked
    against the announced digest before any is handed out.
    """
    info: dict[str, Any] = {}
    if source["method"] == "checkpoint":
        from rlbus.weights.checkpoint import checkpoint_tensors

        return checkpoint_tensors(source["path"], info), info
    if source["method"] == "nccl":
        from rlbus.weights.broadcast import receive_version

        return receive_version(worker, source["announcement"], source["rank"], info), info
    raise ValueError(f"unknown weight source {source.get('method')!r}")

"""`rlbus replay RUN_DIR`: train again on exactly what a run's trainer was given, and compare the weights.

An asynchronous run is not reproducible by running it again: which samples
reach which step depends on timing. It is reproducible from its record. Three
things are kept for this:

- the broker's record of every BATCH it delivered, in step order: the
  trajectory ids of each group in the order sent, and the expired and
  skipped counts (its catalogue's `deliveries`, kept after commit, beside the
  payloads it never deletes);
- the trainer's `RUN_DIR/trainer.json`: the resolved model, the effective
  config (seed, algorithm, optimizer, micro-batch), torch's version and thread
  count, the device;
- deterministic training (`trainer.deterministic`, on by default): torch's
  deterministic algorithms, one seed for every RNG, and the RNG states inside
  each training checkpoint, so a trainer that was restarted continues as if
  it had not been.

The replay builds a trainer from the record (same thread count), trains
every recorded step in order on the rebuilt BATCH messages, writes the
weights of every version the run still has under `RUN_DIR/weights/`, and
compares them file by file, byte for byte; where the run kept a training
checkpoint of a replayed step, it compares its model and optimizer state too.
Bitwise equality needs the same device kind, torch version and thread count
(the replay warns where they differ).
"""

from __future__ import annotations

import filecmp
import json
import platform
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import structlog

log = structlog.get_logger()


class ReplayError(Exception):
    """The run directory cannot be replayed (no record, a gap in the batches, ...)."""


@dataclass
class Comparison:
    what: str  # "weights v12", "checkpoint step 9"
    equal: bool
    detail: str = ""


@dataclass
class Replayed:
    steps: int
    out: Path
    comparisons: list[Comparison] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return bool(self.comparisons) and all(c.equal for c in self.comparisons)


# What replay reads of the record, and of which type (the trainer writes more).
_RECORDED = (("model_path", str), ("config", dict), ("threads", int))


def load_record(run_dir: Path) -> dict:
    """The run's `trainer.json`, its config loaded (a RunConfig), or a ReplayError that says what is wrong with it
    (missing, damaged)."""
    from rlbus.trainer.checkpoint import RECORD

    path = run_dir / RECORD
    if not path.exists():
        raise ReplayError(f"{path} is missing: the trainer writes it when it starts, and runs from before it did "
                          "cannot be replayed")
    try:
        record = json.loads(path.read_text())
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ReplayError(f"{path} is not the JSON the trainer writes ({exc}): it was damaged") from None
    wrong = [k for k, kind in _RECORDED if not isinstance(record, dict) or not isinstance(record.get(k), kind)]
    if wrong:
        raise ReplayError(f"{path} lacks {', '.join(wrong)} (or holds another type): it is no record the trainer "
                          "wrote, or was damaged")
    try:
        from rlbus.common.config import RunConfig

        record["config"] = RunConfig.model_validate(record["config"])
    except ValueError as exc:  # a config no longer valid (written by another version of rlbus), or damaged
        said = "; ".join(line.strip() for line in str(exc).splitlines()[:3])
        raise ReplayError(f"{path}: its config does not load here: {said}") from None
    return record


def replay(run_dir: str | Path, buffer_dir: str | Path | None = None, out_dir: str | Path | None = None,
           steps: int | None = None, progress: Callable[[int, int], None] | None = None) -> Replayed:
    """Train the recorded batches of `run_dir` in order (the first `steps` of them, or all) and compare."""
    import torch

    from rlbus.broker.history import DeliveredBatches
    from rlbus.trainer.main import Trainer
    from rlbus.weights.checkpoint import CheckpointSender, version_dirs

    run_dir = Path(run_dir)
    record = load_record(run_dir)
    cfg = record["config"]
    if not Path(record["model_path"]).exists():
        raise ReplayError(f"the run's model {record['model_path']} is not here; replay needs the same weights to "
                          "start from")
    if not record.get("deterministic", False):
        log.warning("replay_not_deterministic", note="the run trained with trainer.deterministic off: the weights "
                                                       "may differ in their last bits")
    for key, here in (("torch", torch.__version__), ("machine", platform.machine())):
        if record.get(key) != here:
            log.warning("replay_environment_differs", what=key, run=record.get(key), here=here)
    if cfg.trainer.world_size > 1:
        log.warning("replay_world_size_differs", run=cfg.trainer.world_size, here=1,
                    note="the run summed its gradients across ranks in another order than one process does: expect "
                         "differences at float rounding, not equal bits")
    out = Path(out_dir) if out_dir else run_dir / "replay"
    buffer = Path(buffer_dir) if buffer_dir else Path(cfg.buffer.dir or run_dir / "buffer")
    t = cfg.trainer
    cfg = cfg.model_copy(update={
        "run": cfg.run.model_copy(update={"dir": str(out)}),
        # autocast as the run resolved it (auto depends on the machine).
        "trainer": t.model_copy(update={"threads": record["threads"], "checkpoint_every": 0, "world_size": 1,
                                        "autocast": record.get("autocast", t.autocast)}),
    })
    run_versions = dict(version_dirs(run_dir / "weights"))
    run_checkpoints = {int(p.name.split("_")[1]): p for p in (run_dir / "checkpoints").glob("step_*")
                       if (p / "state.pt").exists()}
    sender = CheckpointSender(out / "weights", record["model_path"], dtype=getattr(torch, cfg.rollout.dtype),
                              keep=max(1, len(run_versions)))
    try:  # read before the trainer is built: a buffer that is none is said at once
        history = DeliveredBatches(buffer)
    except sqlite3.DatabaseError as exc:
        raise ReplayError(f"{buffer}: its catalogue cannot be read ({exc}); give the run's buffer directory "
                          "(--buffer)") from None
    with history:
        trainer = Trainer(cfg, record["model_path"], publisher=sender)
        result = Replayed(0, out)
        started = time.monotonic()
        total = sum(1 for _ in history.catalog.deliveries())
        if steps is not None:
            total = min(total, steps)
        for step, reply, _committed in history:
            if step >= total:
                break
            if step != trainer.step:
                raise ReplayError(f"the broker's record has no batch for step {trainer.step} (next: {step}); "
                                  "it was written by an older broker, or the buffer was replaced")
            trainer.train_reply(reply)
            trainer.step, trainer.version = step + 1, step + 1
            result.steps += 1
            if trainer.version in run_versions:
                result.comparisons.append(_compare_weights(trainer, sender, run_versions[trainer.version], step))
            if step in run_checkpoints:
                result.comparisons.append(_compare_checkpoint(trainer, run_checkpoints[step], step))
            if progress is not None:
                progress(result.steps, total)
    log.info("replay_done", steps=result.steps, seconds=round(time.monotonic() - started, 1),
             compared=len(result.comparisons), equal=result.equal, out=str(out))
    return result


def _compare_weights(trainer, sender, theirs: Path, step: int) -> Comparison:
    version = trainer.version
    mine = Path(sender.publish(sender.snapshot(trainer.model), version, step)["location"])
    files = sorted(p.name for p in theirs.glob("*.safetensors"))
    if not files:
        return Comparison(f"weights v{version}", False, f"{theirs} has no .safetensors files")
    differ = [name for name in files if not filecmp.cmp(mine / name, theirs / name, shallow=False)]
    return Comparison(f"weights v{version}", not differ, f"differ: {', '.join(differ)}" if differ else "")


def _compare_checkpoint(trainer, path: Path, step: int) -> Comparison:
    """The run's training checkpoint of `step` against the replay's model and optimizer state after it."""
    import torch

    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    differ = [name for name, tensor in trainer.model.state_dict().items()
              if not torch.equal(tensor.cpu(), state["model"][name])]
    theirs = state["optimizer"]["state"]
    for index, mine in trainer.optimizer.state_dict()["state"].items():
        if any(not torch.equal(v.cpu(), theirs[index][k]) for k, v in mine.items() if torch.is_tensor(v)):
            differ.append(f"optimizer state {index}")
    detail = f"{len(differ)} tensors differ, first {differ[0]}" if differ else ""
    return Comparison(f"checkpoint step {step}", not differ, detail)

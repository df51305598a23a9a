"""Training checkpoints for resume: model, optimizer, scheduler, RNG states, step and version; and the
record `rlbus replay` reads (`trainer.json`).

Saved as `checkpoints/step_XXXXXXXX/` through a temporary directory and an
atomic rename; the newest complete one is what a restarted trainer resumes
from. A single-process trainer writes `state.pt`; a sharded one (FSDP2,
trainer/distributed.py) writes `shards/` with torch.distributed.checkpoint,
each rank its own shards, and `meta.pt` (scheduler, rank 0's RNG, step,
version). Either kind resumes at any world size: DCP reshards on load, and
a `state.pt` is read whole and sharded. The trainer COMMITs a step to the broker only once a checkpoint covers
it, so the broker re-delivers exactly the batches a resumed trainer has not
trained yet.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save(directory: str | Path, step: int, version: int, model, optimizer, scheduler, keep: int = 2) -> Path:
    tmp = _begin(Path(directory), step)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "rng": rng_state(), "step": step, "version": version},
               tmp / "state.pt")
    return _finish(tmp, "state.pt", keep)


def _begin(root: Path, step: int) -> Path:
    """A fresh temporary directory for the checkpoint of `step`."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".step_{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _finish(tmp: Path, written: str, keep: int) -> Path:
    """Make `tmp` (its file `written` last) durable and rename it into place as `step_N/`; keep the newest `keep`."""
    root, final = tmp.parent, tmp.parent / tmp.name.removeprefix(".").removesuffix(".tmp")
    with open(tmp / written, "rb") as f:
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # a step saved again (a resumed run): set the old copy aside, never delete it first
        stale = root / f".{final.name}.old"
        shutil.rmtree(stale, ignore_errors=True)
        os.rename(final, stale)
        _fsync_dir(root)
        shutil.rmtree(stale, ignore_errors=True)
    os.rename(tmp, final)
    _fsync_dir(root)  # the rename is durable before the trainer COMMITs the steps this checkpoint covers
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest(directory: str | Path) -> Path | None:
    found = sorted(p.parent for p in Path(directory).glob("step_*/*.pt") if p.name in ("state.pt", META))
    return found[-1] if found else None


class CheckpointMismatch(ValueError):
    """A checkpoint whose parameters are not this model's (one of another run, of another model)."""


def _check_fits(saved: dict[str, tuple[int, ...]], model) -> None:
    """Raise CheckpointMismatch naming the first parameter whose shape differs between the checkpoint and `model`
    (global shapes, sharded or not), or when they have no parameter name in common."""
    here = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    common = saved.keys() & here.keys()
    differ = sorted(name for name in common if saved[name] != here[name])
    if not common:
        raise CheckpointMismatch(f"none of its {len(saved)} parameters is named as one of this model's")
    if differ:
        more = f" ({len(differ) - 1} more differ)" if len(differ) > 1 else ""
        raise CheckpointMismatch(f"{differ[0]} is {list(saved[differ[0]])} in it and {list(here[differ[0]])} in "
                                 f"this model{more}")


def load(path: str | Path, model, optimizer, scheduler, sharded: bool = False) -> tuple[int, int]:
    """Restore everything into `model` (sharded or not, whichever kind the checkpoint is); returns (step,
    version) of the checkpoint. CheckpointMismatch if its parameters' shapes are not the model's."""
    path = Path(path)
    if (path / META).exists():
        return _load_shards(path, model, optimizer, scheduler)
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    _check_fits({name: tuple(t.shape) for name, t in state["model"].items()}, model)
    if sharded:
        _load_whole_into_shards(state, model, optimizer)
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state["step"], state["version"]


# ---- sharded (FSDP2) --------------------------------------------------------

META = "meta.pt"  # beside shards/ in a sharded checkpoint


def save_sharded(directory: str | Path, step: int, version: int, model, optimizer, scheduler, world,
                 keep: int = 2) -> Path:
    """A checkpoint of a sharded trainer; collective (every rank calls it), rank 0 renames it into place."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = Path(directory)
    tmp = _begin(root, step) if world.main else root / f".step_{step:08d}.tmp"
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp / "shards")  # fsyncs its files
    final = root / f"step_{step:08d}"
    if world.main:
        torch.save({"scheduler": scheduler.state_dict(), "rng": rng_state(), "step": step, "version": version,
                    "world_size": world.size}, tmp / META)
        _finish(tmp, META, keep)
    dist.barrier()  # every rank sees the checkpoint in place before rank 0 COMMITs its steps
    return final


def _load_shards(path: Path, model, optimizer, scheduler) -> tuple[int, int]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    stored = dcp.FileSystemReader(path / "shards").read_metadata().state_dict_metadata
    _check_fits({key.removeprefix("model."): tuple(meta.size) for key, meta in stored.items()
                       if key.startswith("model.") and hasattr(meta, "size")}, model)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=path / "shards")  # resharded to this world's layout, whatever wrote it
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    meta = torch.load(path / META, map_location="cpu", weights_only=False)
    scheduler.load_state_dict(meta["scheduler"])
    set_rng_state(meta["rng"])
    return meta["step"], meta["version"]


def _load_whole_into_shards(state: dict, model, optimizer) -> None:
    """A single-process checkpoint into a sharded model: the optimizer's states, keyed there by parameter index,
    are re-keyed by name (the order of `model.parameters()`, which both optimizers were built over)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = [n for n, _ in model.named_parameters()]
    saved = state["optimizer"]
    optim = {"state": {names[i]: v for i, v in saved["state"].items()},
             "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optim,
                   options=StateDictOptions(full_state_dict=True))


RECORD = "trainer.json"  # in the run directory


def write_record(cfg, model_path: str, step: int, autocast: str) -> None:
    """`RUN_DIR/trainer.json`, written when the trainer starts: what `rlbus replay` needs besides the broker's
    record of the batches (the resolved model, the effective config, torch's version and thread count, and the
    precision `trainer.autocast` resolved to, by name)."""
    t = cfg.trainer
    record = {"model_path": str(Path(model_path).resolve()), "config": cfg.model_dump(mode="json"),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "device": t.device,
              "deterministic": t.deterministic, "machine": platform.machine(), "started_step": step,
              "autocast": autocast}
    path = Path(cfg.run.dir) / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, path)


def read_record(run_dir: str | Path) -> dict | None:
    """The run directory's `trainer.json`, or None where there is none (or none that reads as JSON)."""
    try:
        return json.loads((Path(run_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return None

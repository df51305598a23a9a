"""Training checkpoints for resume: model, optimizer, scheduler, RNG states, step and version; and the
record `rlbus replay` reads (`trainer.json`).

Saved as `checkpoints/step_XXXXXXXX/` through a temporary directory and an
atomic rename; the newest complete one is what a restarted trainer resumes
from. The trainer COMMITs a step to the broker only once a checkpoint covers
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
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".step_{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "rng": rng_state(), "step": step, "version": version},
               tmp / "state.pt")
    with open(tmp / "state.pt", "rb") as f:
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # a step saved again (a resumed run): set the old copy aside, never delete it first
        stale = root / f".step_{step:08d}.old"
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
    found = sorted(Path(directory).glob("step_*/state.pt"))
    return found[-1].parent if found else None


def load(path: str | Path, model, optimizer, scheduler) -> tuple[int, int]:
    """Restore everything; returns (step, version) of the checkpoint."""
    state = torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state["step"], state["version"]


RECORD = "trainer.json"  # in the run directory


def write_record(cfg, model_path: str, step: int) -> None:
    """`RUN_DIR/trainer.json`, written when the trainer starts: what `rlbus replay` needs besides the broker's
    record of the batches (the resolved model, the effective config, torch's version and thread count)."""
    t = cfg.trainer
    record = {"model_path": str(Path(model_path).resolve()), "config": cfg.model_dump(mode="json"),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "device": t.device,
              "deterministic": t.deterministic, "machine": platform.machine(), "started_step": step}
    path = Path(cfg.run.dir) / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, path)

"""Publishing weights to explorers, behind one small interface.

`Publisher.publish(model, version, step)` makes the weights available and
returns the weight state that goes into PUBLISH (version, method, location,
digest, step). `CheckpointPublisher` writes `weights/v{version}/`
(safetensors, config, tokenizer, chat template) into a temporary directory,
fsyncs it, computes the digest, and renames it into place atomically, so an
explorer never sees half a checkpoint. The broadcast publisher plugs in
beside it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Protocol

from common.weights.digest import weights_digest

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json", "vocab.json", "merges.txt")


class Publisher(Protocol):
    def publish(self, model, version: int, step: int) -> dict[str, Any]: ...


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    """fsync every file of a flat directory, then the directory."""
    for file in path.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(path)


class CheckpointPublisher:
    def __init__(self, weights_dir: str | Path, base_model_dir: str | Path, keep: int = 3, dtype=None):
        self.dir = Path(weights_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.base = Path(base_model_dir)
        self.keep = keep
        self.dtype = dtype  # the explorers' dtype: half the bytes of float32 for bfloat16, no cast on load

    def publish(self, model, version: int, step: int) -> dict[str, Any]:
        final = self.dir / f"v{version}"
        tmp = self.dir / f".v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        state = None
        if self.dtype is not None:
            state = {k: v.detach().to(self.dtype) for k, v in model.state_dict().items()}
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state)
        for name in _TOKENIZER_FILES:
            if (self.base / name).exists():
                shutil.copy2(self.base / name, tmp / name)
        _fsync_tree(tmp)
        digest = weights_digest(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.dir)
        self._prune(version)
        return {"version": version, "method": "checkpoint", "location": str(final.resolve()), "digest": digest,
                "step": step}

    def _prune(self, newest: int) -> None:
        # Explorers may still be loading a recent version: keep a few.
        for path in self.dir.glob("v*"):
            if path.name[1:].isdigit() and int(path.name[1:]) <= newest - self.keep:
                shutil.rmtree(path, ignore_errors=True)

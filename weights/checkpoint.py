"""Weight sync by checkpoint: the sender writes `weights/v{version}/`, receivers read it by path.

`CheckpointSender.snapshot(model)` copies the weights (one memory copy, in
the explorers' dtype) so training can go on; `publish(snapshot, version,
step)`, run on the trainer's publishing thread, writes safetensors, config,
tokenizer and chat template into a temporary directory, fsyncs it, renames it
into place atomically, so an explorer never sees half a checkpoint, and
computes its digest. It returns the weight state that goes into PUBLISH
(version, method, location, digest, step). `checkpoint_tensors` is the
receiving side: it runs inside the engine's workers.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Iterator

from rlbus.weights.digest import weights_digest

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json", "vocab.json", "merges.txt")


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


def umask() -> int:
    """This process's umask, read without setting it (os.umask would change it for every thread meanwhile)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def modes_as_umask(path: Path) -> None:
    """Give every file of a flat directory the mode a plain open() gives it under this process's umask.
    safetensors writes its files 0600 whatever the umask, so saved weights were readable by their owner only:
    not by an explorer or an evaluation running as another user on a shared file system."""
    mode = 0o666 & ~umask()
    for file in path.iterdir():
        if file.is_file() and file.stat().st_mode & 0o777 != mode:
            file.chmod(mode)


class CheckpointSender:
    method = "checkpoint"

    def __init__(self, weights_dir: str | Path, base_model_dir: str | Path, keep: int = 3, dtype=None,
                 server=None):
        self.dir = Path(weights_dir)
        self.server = server  # a WeightServer over self.dir, announced in every state
        self.dir.mkdir(parents=True, exist_ok=True)
        self.base = Path(base_model_dir)
        self.keep = keep
        self.dtype = dtype  # the explorers' dtype: half the bytes of float32 for bfloat16, no cast on load
        self.published: tuple[int, str] | None = None  # the last version written, and its digest

    def attach(self, client) -> None:
        """Files need no broker connection."""

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def snapshot(self, model) -> tuple[Any, dict[str, Any]]:
        """The model and a copy of its weights, taken now (training may change them meanwhile)."""
        copies: dict[Any, Any] = {}
        state = {}
        source = model.state_dict()
        # A sharded trainer's state (trainer/distributed.py) is gathered as it is read, each tensor freed once
        # copied, so its storage says nothing about ties; it names them itself.
        tie = getattr(source, "tie", None)
        for name, tensor in source.items():
            # Tied weights (embedding and LM head) stay one tensor, so they are saved once.
            key = tie[name] if tie is not None else tensor.data_ptr()
            if key not in copies:
                copies[key] = tensor.detach().to(self.dtype or tensor.dtype, copy=True)
            state[name] = copies[key]
        return model, state

    def publish(self, snapshot: tuple[Any, dict[str, Any]], version: int, step: int) -> dict[str, Any]:
        model, state = snapshot
        final = self.dir / f"v{version}"
        tmp = self.dir / f".v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state)
        for name in _TOKENIZER_FILES:
            if (self.base / name).exists():
                shutil.copy2(self.base / name, tmp / name)
        modes_as_umask(tmp)
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.dir)
        self._prune(version)
        # With a server, the digest comes from the same read that makes the version's manifest.
        digest = self.server.add(version, self.published) if self.server is not None else weights_digest(final)
        self.published = (version, digest)
        state = {"version": version, "method": "checkpoint", "location": str(final.resolve()), "digest": digest,
                 "step": step}
        if self.server is not None:
            state["fetch_from"] = self.server.address
            if self.server.public_key:
                state["fetch_key"] = self.server.public_key
        return state

    def _prune(self, newest: int) -> None:
        # Explorers may still be loading a recent version, and take deltas against the one they hold: keep the
        # newest few published, whatever their numbers' spacing (sync_interval). Versions above `newest` are a
        # run's before a restart: written over as they come again, never pruned in their place.
        published = [path for version, path in version_dirs(self.dir) if version <= newest]
        for path in published[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)


def version_dirs(directory: str | Path) -> list[tuple[int, Path]]:
    """The published versions under `directory` (`v{N}/`), oldest first."""
    found = [(int(p.name[1:]), p) for p in Path(directory).glob("v*") if p.name[1:].isdigit() and p.is_dir()]
    return sorted(found)


def checkpoint_tensors(path: str | Path, info: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Every tensor of the safetensors files under `path`, by name (counted in `info["tensors"]`)."""
    from safetensors.torch import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    info["tensors"] = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                info["tensors"] += 1
                yield name, f.get_tensor(name)

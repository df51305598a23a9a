"""Digests of published weights, checked by explorers before they load them.

A digest covers the bytes of every `*.safetensors` file in a weights
directory, in name order, so a torn or half-copied checkpoint is refused.
BLAKE2b is in the standard library and reads about as fast as the disk.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

ALGORITHM = "blake2b"
_CHUNK = 8 << 20


def weights_digest(directory: str | Path) -> str:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {directory}")
    h = hashlib.blake2b(digest_size=20)
    for path in files:
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return f"{ALGORITHM}:{h.hexdigest()}"

"""Digests of published weights, checked by explorers before they load them, and the per-chunk hashes of the
weight server's manifests (`chunk_hashes`, `scan_version`).

A digest covers the bytes of every `*.safetensors` file in a weights
directory, in name order, so a torn or half-copied checkpoint is refused. It
names its algorithm (`xxh3_128:...` or `blake2b:...`) and is checked with the
same one. xxh3 (the `xxhash` package, installed with the engine) hashes the
bundled model in a few hundredths of a second; BLAKE2b, from the standard
library, is the fallback and takes about 0.6 s here, most of a reload.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable

_CHUNK = 4 << 20


def hasher(algorithm: str):
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if algorithm == "blake2b":
        return hashlib.blake2b(digest_size=20)
    raise ValueError(f"unknown digest algorithm {algorithm!r}")


def default_algorithm() -> str:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "blake2b"
    return "xxh3_128"


class Digest:
    """A digest being taken: each `*.safetensors` file in name order, `file(name)` and then its bytes."""

    def __init__(self, algorithm: str):
        self.algorithm = algorithm
        self._h = hasher(algorithm)

    def file(self, name: str) -> None:
        self._h.update(name.encode() + b"\0")

    def update(self, data) -> None:
        self._h.update(data)

    def value(self) -> str:
        return f"{self.algorithm}:{self._h.hexdigest()}"


def weights_digest(directory: str | Path, algorithm: str | None = None) -> str:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {directory}")
    digest = Digest(algorithm or default_algorithm())
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    for path in files:
        digest.file(path.name)
        with open(path, "rb") as f:
            while n := f.readinto(buf):
                digest.update(view[:n])
    return digest.value()


def matches(directory: str | Path, digest: str) -> tuple[bool, str]:
    """Whether the directory's bytes have `digest` (computed with the algorithm it names), and the actual one."""
    algorithm = digest.partition(":")[0]
    actual = weights_digest(directory, algorithm)
    return actual == digest, actual


def chunk_hashes(path: Path, chunk_bytes: int, feed: Callable[[memoryview], None] | None = None
                 ) -> tuple[list[int], str]:
    """The xxh3-64 of every chunk of a file and the xxh3-128 of the whole, in one read (each chunk also goes to
    `feed`, if given)."""
    import xxhash

    whole = xxhash.xxh3_128()
    hashes = []
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            hashes.append(xxhash.xxh3_64_intdigest(view[:n]))
            whole.update(view[:n])
            if feed is not None:
                feed(view[:n])
    return hashes, whole.hexdigest()


def scan_version(target: Path, chunk_bytes: int, algorithm: str | None = None) -> tuple[str, list[dict[str, Any]]]:
    """A version directory's digest (`weights_digest`) and the manifest entries of its files served whole, in
    one read of its files."""
    digest = Digest(algorithm or default_algorithm())
    files = []
    for path in sorted(p for p in target.iterdir() if p.is_file() and not p.name.startswith(".")):
        weights = path.suffix == ".safetensors"
        if weights:  # in name order, as weights_digest takes them
            digest.file(path.name)
        hashes, whole = chunk_hashes(path, chunk_bytes, digest.update if weights else None)
        files.append({"name": path.name, "size": path.stat().st_size, "xxh": whole, "chunks": hashes,
                      "source": str(path)})
    if not any(f["name"].endswith(".safetensors") for f in files):
        raise FileNotFoundError(f"no .safetensors files in {target}")
    return digest.value(), files

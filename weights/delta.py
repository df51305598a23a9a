"""Weight deltas: the bytes of version w as XOR against version v, compressed with zstd.

A published version is a directory of safetensors files. Between two
versions of the same model every file has the same header (names, dtypes,
shapes, offsets) and the same length; only tensor bytes differ, and with
Adam steps of ~1e-5 most bf16 values do not change at all between versions.
XOR of the two files is therefore mostly zero bytes, which zstd compresses
to about 1% of the file on the default job (one version apart; 1.6% two
apart). XOR needs no knowledge of dtypes: it works the same for bf16, fp16
and fp32, and applying it is exact, so the result is checked against the
version's digest like any other copy.

`make_delta` writes the compressed delta of one file, or returns None when
the two files differ in length or header (no delta possible) or the delta
would be no smaller than the file itself. `apply_delta` rebuilds the target
file from the base file and the delta. Both stream in blocks, so neither
holds a whole file in memory.

The weight server builds deltas in a child process, `python -m
rlbus.weights.delta [--idle] BASE TARGET OUT`, which prints
`{"size": bytes or null, "idle": whether it ran at idle priority, "cpu_s"}`: see
weights/manifests.py for why not in a thread.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
from pathlib import Path

BLOCK = 16 << 20
LEVEL = 1  # zstd level 3 gives the same size on weight XORs (measured) and costs more time


def _header(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return head
        (n,) = struct.unpack("<Q", head)
        return head + f.read(min(n, 100 << 20))


def compatible(base: str | Path, target: str | Path) -> bool:
    """Whether a delta from `base` to `target` is possible: same length and the same safetensors header."""
    base, target = Path(base), Path(target)
    return base.stat().st_size == target.stat().st_size and _header(base) == _header(target)


def make_delta(base: str | Path, target: str | Path, out: str | Path) -> int | None:
    """Write zstd(base XOR target) to `out`; its size, or None when no delta is possible or worth it."""
    import numpy as np  # here, not at the top: the builder's child sets its priority before it imports them
    import zstandard

    base, target, out = Path(base), Path(target), Path(out)
    if not compatible(base, target):
        return None
    size = target.stat().st_size
    tmp = out.with_name(out.name + ".tmp")
    cctx = zstandard.ZstdCompressor(level=LEVEL)
    with open(base, "rb") as fb, open(target, "rb") as ft, open(tmp, "wb") as fo:
        with cctx.stream_writer(fo, size=size, closefd=False) as writer:
            while True:
                a = fb.read(BLOCK)
                if not a:
                    break
                b = ft.read(BLOCK)
                writer.write(np.bitwise_xor(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)).data)
        fo.flush()
        os.fsync(fo.fileno())
    written = tmp.stat().st_size
    if written >= size:
        tmp.unlink()
        return None
    os.replace(tmp, out)
    return written


def apply_delta(base: str | Path, delta: str | Path, out: str | Path) -> int:
    """Write base XOR unzstd(delta) to `out` (over its bytes when it exists: see weights/fetch.py); the bytes
    written. Raises ValueError on a delta that does not fit."""
    import numpy as np
    import zstandard

    base, delta, out = Path(base), Path(delta), Path(out)
    size = base.stat().st_size
    written = 0
    dctx = zstandard.ZstdDecompressor()
    with open(base, "rb") as fb, open(delta, "rb") as fd, open(out, "r+b" if out.is_file() else "wb") as fo:
        reader = dctx.stream_reader(fd)
        while True:
            x = reader.read(BLOCK)
            if not x:
                break
            a = fb.read(len(x))
            if len(a) != len(x):
                raise ValueError(f"delta {delta} is longer than its base {base} ({size} bytes)")
            fo.write(np.bitwise_xor(np.frombuffer(a, np.uint8), np.frombuffer(x, np.uint8)).data)
            written += len(x)
        fo.truncate(written)
    if written != size:
        raise ValueError(f"delta {delta} covers {written} bytes, its base {base} has {size}")
    return written


def idle_priority() -> bool:
    """Run the calling thread only on CPU nothing else wants: SCHED_IDLE, else the lowest niceness. Linux only
    (there scheduling is per thread; elsewhere it would lower the whole process). Whether it took."""
    if sys.platform != "linux":
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return True
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> None:
    """Write the delta of TARGET against BASE to OUT; print its size (null: none), whether it ran at idle
    priority and the CPU seconds it took, as JSON."""
    import argparse
    import json
    import time

    parser = argparse.ArgumentParser(prog="python -m rlbus.weights.delta", description=main.__doc__)
    parser.add_argument("--idle", action="store_true", help="run at idle priority (SCHED_IDLE on Linux)")
    parser.add_argument("base")
    parser.add_argument("target")
    parser.add_argument("out")
    args = parser.parse_args(argv)
    idle = idle_priority() if args.idle else False
    size = make_delta(args.base, args.target, args.out)
    print(json.dumps({"size": size, "idle": idle, "cpu_s": round(time.process_time(), 3)}), flush=True)


if __name__ == "__main__":
    main()

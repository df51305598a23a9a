"""What every benchmark needs: a free loopback port and a real broker process for the run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Iterator

from rlbus.common.processes import terminate_with

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def broker_process(sets: list[str], buffer_dir: Path, profile: str = "") -> Iterator[subprocess.Popen]:
    """`rlbus broker` with `--set` overrides, ready when this yields; stopped with SIGTERM after."""
    prefix = ["-m", "cProfile", "-o", profile] if profile else []
    cmd = [sys.executable, *prefix, "-m", "rlbus.cli", "broker"] + [x for s in sets for x in ("--set", s)]
    # SIGTERM when this benchmark dies, even by SIGKILL: a broker left behind would hold its ports for ever.
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, preexec_fn=partial(terminate_with, os.getpid()))
    try:
        endpoints = Path(buffer_dir) / "endpoints.json"
        while not endpoints.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"the broker exited with {proc.returncode}")
            time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        proc.wait(60)

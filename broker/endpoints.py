"""`endpoints.json` in the buffer directory: the addresses a broker bound, written once it serves.

Whoever starts a broker on port 0 (`rlbus up`, the benchmarks, the tests) learns its ports here. The file
names the broker's pid, so a file left by an earlier broker is never taken for the new one's.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

NAME = "endpoints.json"


def write(buffer_dir: Path, host: str, port: int, pub_port: int) -> None:
    path = Path(buffer_dir) / NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"router": f"tcp://{host}:{port}", "pub": f"tcp://{host}:{pub_port}",
                               "pid": os.getpid()}))
    os.replace(tmp, path)  # readers that poll for the file never see it half written


def bound_ports(buffer_dir: Path, proc: subprocess.Popen, timeout: float | None = None) -> tuple[int, int] | None:
    """The request and bus ports of the broker process `proc` once it serves; None if it exits first.
    TimeoutError after `timeout` seconds (None: no limit)."""
    path = Path(buffer_dir) / NAME
    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is None or time.monotonic() < deadline:
        try:
            bound = json.loads(path.read_text())
        except FileNotFoundError:
            bound = {}
        if bound.get("pid") == proc.pid:
            router, pub = (int(bound[k].rpartition(":")[2]) for k in ("router", "pub"))
            return router, pub
        if proc.poll() is not None:
            return None
        time.sleep(0.05)
    raise TimeoutError(f"the broker did not serve within {timeout} s")

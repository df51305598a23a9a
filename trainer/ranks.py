"""`rlbus trainer` with `trainer.world_size` > 1 on one host: start the ranks and watch them.

Each rank is `rlbus trainer` again, with the effective config (written to
`RUN_DIR/trainer.ranks.yaml`) and torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT on loopback). The rendezvous port is
bound here, before any rank starts, and its socket handed to rank 0, whose
store serves on it (`STORE_FD`): no other process can take the port between
choosing and binding it. This process stays as the ranks' supervisor:

- SIGTERM, SIGINT or SIGHUP is passed on to rank 0, which stops after its
  step and tells the others to stop.
- A rank that exits with an error or is killed stops the trainer at once: the
  others get SIGTERM, then SIGKILL after `STOP_GRACE_S` (they may be blocked
  in a collective with the dead rank), and `rlbus trainer` exits 1 naming the
  rank. A restarted trainer resumes from the last checkpoint; the broker
  re-delivers the steps it had not committed.
- Ranks get SIGTERM if this process dies, even by SIGKILL.

Across several hosts, torchrun starts the ranks instead (it watches them the
same way), and this module is not used.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import structlog

from rlbus.common.config import RunConfig, dump_config
from rlbus.common.processes import on_stop_signals, terminate_with

log = structlog.get_logger()

STOP_GRACE_S = 5.0  # after a rank died: how long the others get to stop before SIGKILL
CONFIG = "trainer.ranks.yaml"  # in the run directory
STORE_FD = "RLBUS_STORE_FD"  # rank 0: the listening socket its rendezvous store serves on; the others: empty


def rank_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) in a rank started by `supervise` or torchrun; None elsewhere."""
    if "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def _describe(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def supervise(cfg: RunConfig) -> int:
    """Run the trainer's `world_size` ranks to their end; the exit code for `rlbus trainer`."""
    size = cfg.trainer.world_size
    config = Path(cfg.run.dir) / CONFIG
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(dump_config(cfg))
    me = os.getpid()
    ranks: list[subprocess.Popen] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port, fd = listener.getsockname()[1], listener.fileno()
        for rank in range(size):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   STORE_FD: str(fd) if rank == 0 else ""}
            ranks.append(subprocess.Popen([sys.executable, "-m", "rlbus.cli", "trainer", str(config)], env=env,
                                          stdin=subprocess.DEVNULL, pass_fds=(fd,) if rank == 0 else (),
                                          preexec_fn=lambda: terminate_with(me)))
    log.info("trainer_ranks_started", world_size=size, pids=[p.pid for p in ranks], master_port=port)

    def stop(*_) -> None:  # rank 0 stops at its step's end and then tells the others
        if ranks[0].poll() is None:
            ranks[0].send_signal(signal.SIGTERM)

    on_stop_signals(stop)
    while True:
        codes = [p.poll() for p in ranks]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            log.error("trainer_rank_failed", rank=rank, pid=ranks[rank].pid, reason=_describe(code),
                      note="the other ranks are stopped; a restarted trainer resumes from the last checkpoint")
            _stop_all(ranks)
            print(f"error: trainer rank {rank} (pid {ranks[rank].pid}) {_describe(code)}; the trainer stopped",
                  file=sys.stderr)
            return 1
        if all(code == 0 for code in codes):
            log.info("trainer_ranks_done", world_size=size)
            return 0
        time.sleep(0.1)


def _stop_all(ranks: list[subprocess.Popen]) -> None:
    for p in ranks:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in ranks):
        time.sleep(0.05)
    for p in ranks:
        if p.poll() is None:
            p.kill()
        p.wait()

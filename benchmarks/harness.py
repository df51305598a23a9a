"""What every benchmark needs: a real broker process for the run, on ports it binds itself, the CPU time of
processes and their threads (Linux /proc), this disk's rate of fdatasync'd writes, a bare ZeroMQ hop,
checked arguments, and the record of one measured case."""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Iterator

from rlbus.broker import endpoints
from rlbus.common.processes import terminate_with

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    """One measured case: trajectories/s, PUT-to-ACK latencies, and the CPU seconds each side spent."""

    rate: float
    latencies: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)  # producers, broker, consumer
    producers_done_s: float = 0.0  # when the last producer had its last ACK (the consumer may still be taking)
    consumer_done_s: float = 0.0
    broker_threads: dict[str, float] = field(default_factory=dict)  # the broker's CPU by `thread_cpu_by_role`

    def cpu_line(self, trajectories: int) -> str:
        """CPU seconds per 10,000 trajectories, by side: where a 2-core machine's time goes."""
        per = {k: v * 10_000 / trajectories for k, v in self.cpu.items()}
        line = ", ".join(f"{k} {v:.2f}" for k, v in per.items()) + f"; total {sum(per.values()):.2f}"
        if self.broker_threads:
            line += "; the broker's by thread: " + ", ".join(
                f"{role} {v * 10_000 / trajectories:.2f}" for role, v in sorted(self.broker_threads.items()))
        return line

    def cpu_bound(self, work: float) -> float:
        """The most work a second this process's cores could carry, for a case that did `work` in all, at the CPU
        every side spent on it here: were the cores busy every moment, no side ever waiting on another."""
        return len(os.sched_getaffinity(0)) * work / sum(self.cpu.values())


def at_least(low: int, multiple_of: int = 1):
    """An argparse type: a whole number of at least `low` (and a multiple of `multiple_of`), or a usage error
    that says so, rather than a run that divides by zero or waits for ever for work it never made."""

    def parse(text: str) -> int:
        value = int(text)  # not a number: argparse says "invalid int value"
        if value < low or value % multiple_of:
            every = f" and a multiple of {multiple_of}" if multiple_of > 1 else ""
            raise argparse.ArgumentTypeError(f"must be {low} or more{every}, not {value}")
        return value

    parse.__name__ = "int"
    return parse


@dataclass
class Broker:
    proc: subprocess.Popen
    port: int
    pub_port: int

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"


def bound_ports(buffer_dir: Path, proc: subprocess.Popen) -> tuple[int, int]:
    """The request and bus ports of the broker `proc` (started with `broker.port=0`), once it serves."""
    ports = endpoints.bound_ports(buffer_dir, proc)
    if ports is None:
        raise RuntimeError(f"the broker exited with {proc.returncode}")
    return ports


@contextmanager
def broker_process(sets: list[str], buffer_dir: Path, profile: str = "", config: Path | None = None
                   ) -> Iterator[Broker]:
    """`rlbus broker` (of `config`, when given) with `--set` overrides, on ports it picks itself (no other process
    can take them between choosing and binding), ready when this yields; stopped with SIGTERM after."""
    prefix = ["-m", "cProfile", "-o", profile] if profile else []
    sets = ["broker.port=0", "broker.pub_port=0", *sets]
    cmd = [sys.executable, *prefix, "-m", "rlbus.cli", "broker", *([str(config)] if config else [])]
    cmd += [x for s in sets for x in ("--set", s)]
    # SIGTERM when this benchmark dies, even by SIGKILL: a broker left behind would hold its ports for ever.
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, preexec_fn=partial(terminate_with, os.getpid()))
    try:
        yield Broker(proc, *bound_ports(buffer_dir, proc))
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        proc.wait(60)


def stat_cpu(stat: Path) -> tuple[float, float]:
    """From a /proc stat file (a process's, or one of its threads'): user + system CPU seconds, and those of the
    children it has waited for."""
    fields = stat.read_text().rpartition(")")[2].split()  # after the command name, which may hold spaces
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process so far."""
    return stat_cpu(Path(f"/proc/{pid}/stat"))[0]


def thread_cpu(pid: int) -> tuple[dict[int, float], float]:
    """CPU seconds of each thread of process `pid`, and of its children it has waited for; empty once it is gone."""
    threads = {}
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                threads[int(task.name)] = stat_cpu(task / "stat")[0]
            except (FileNotFoundError, ProcessLookupError):
                continue
        return threads, stat_cpu(Path(f"/proc/{pid}/stat"))[1]
    except (FileNotFoundError, ProcessLookupError):
        return threads, 0.0


def thread_cpu_by_role(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread of process `pid`: (its role, its CPU seconds so far). Roles: `loop` (the main thread),
    `zmq_io` (ZeroMQ's I/O threads: the socket copies), a thread's OS name where it set one (`rlbus-writer`),
    else `other`."""
    threads = {}
    for tid, cpu in thread_cpu(pid)[0].items():
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
        role = ("loop" if tid == pid else "zmq_io" if name.startswith("ZMQbg/IO") else
                name if name.startswith("rlbus-") else "other")
        threads[tid] = (role, cpu)
    return threads


def by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each role spent between two `thread_cpu_by_role` readings."""
    spent: dict[str, float] = {}
    for tid, (role, cpu) in after.items():
        spent[role] = spent.get(role, 0.0) + cpu - before.get(tid, (role, 0.0))[1]
    return spent


def disk_fdatasync_mb_per_s(directory: Path, block: bytes, total_bytes: int, direct: bool = False) -> float:
    """This disk's sequential write rate, writing `block` again and again with one fdatasync after each, as a
    group commit does; `direct`: through O_DIRECT (0.0 where the filesystem refuses it)."""
    if direct:  # O_DIRECT takes page-aligned memory
        aligned = mmap.mmap(-1, len(block))
        aligned[:] = block
        block = aligned
    path = directory / "disk-baseline.bin"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    except OSError:
        return 0.0
    try:
        start, offset = time.perf_counter(), 0
        while offset < total_bytes:
            os.pwrite(fd, block, offset)
            os.fdatasync(fd)
            offset += len(block)
        elapsed = time.perf_counter() - start
    except OSError:
        return 0.0
    finally:
        os.close(fd)
        path.unlink()
    return offset / elapsed / 1e6


def disk_rates(directory: Path, blocks: dict[int, bytes], total_bytes: int,
               kinds: tuple[bool, ...] = (False, True)) -> dict[tuple[int, bool], float]:
    """`disk_fdatasync_mb_per_s` for each block size, buffered and direct (`kinds`: the one or the other only):
    {(size, direct): MB/s}."""
    return {(size, direct): disk_fdatasync_mb_per_s(directory, block, total_bytes, direct)
            for direct in kinds for size, block in blocks.items()}


def relay(messages: int, results) -> None:
    """A bare ZeroMQ hop: what a broker that stored nothing and checked nothing would cost. Puts its two ports
    (in, out) on `results`, then its CPU seconds."""
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    results.put([sock.bind_to_random_port("tcp://127.0.0.1") for sock in (pull, push)])
    cpu = time.process_time()
    for _ in range(messages):
        push.send_multipart(pull.recv_multipart(copy=False), copy=False)
    push.close(linger=-1)
    pull.close(0)
    ctx.term()
    results.put(time.process_time() - cpu)

"""Where a benchmark's bytes travel: the rate of plain TCP over loopback, or over a shaped link to a network
namespace that stands for another host (benchmarks/weight_sync.py --link-mbit)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator


def loopback_mb_s(nbytes: int) -> float:
    """MB/s of a plain TCP stream of `nbytes` over loopback, between two threads (best of 3)."""
    block = bytearray(4 << 20)
    best = 0.0
    for _ in range(3):
        listener = socket.create_server(("127.0.0.1", 0))
        got = [0]

        def sink():
            conn, _ = listener.accept()
            buf = bytearray(4 << 20)
            while n := conn.recv_into(buf):
                got[0] += n
            conn.close()

        reader = threading.Thread(target=sink)
        reader.start()
        started = time.perf_counter()
        with socket.create_connection(listener.getsockname()) as out:
            sent = 0
            while sent < nbytes:
                out.sendall(block)
                sent += len(block)
        reader.join()
        best = max(best, got[0] / (time.perf_counter() - started) / 1e6)
        listener.close()
    return best


LINK = ("10.232.0.1", "10.232.0.2")  # this host's end, the explorers' end
PREFIX = "rlws"  # + the pid of the benchmark that made the link: its namespace, and the veth ends with h and e


def _drop(tag: str) -> None:
    subprocess.run(["ip", "link", "del", f"{tag}h"], capture_output=True)
    subprocess.run(["ip", "netns", "del", tag], capture_output=True)


def _clear_the_address() -> None:
    """Drop the links of benchmarks that died without taking theirs down (SIGKILL runs no cleanup); every link
    has the same addresses, so one left behind would cut every later run's explorers off. A link whose
    benchmark is alive is refused with its name instead."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for tag in listed:
        owner = re.fullmatch(rf"{PREFIX}(\d+)", tag)
        if owner and not os.path.exists(f"/proc/{owner.group(1)}"):
            _drop(tag)
    held = subprocess.run(["ip", "-br", "-4", "addr", "show", "to", f"{LINK[0]}/32"], capture_output=True,
                          text=True).stdout.split()
    if held:
        raise SystemExit(f"cannot make the link: {LINK[0]} is held by interface {held[0]} (another benchmark's "
                         f"link, or one of this host's own); take it down, or wait for that benchmark to end")


@contextmanager
def link(mbit: float) -> Iterator[str]:
    """A second network namespace for the explorers, joined to this one by a veth link whose direction towards
    them (chunks, as from a trainer on another host) is shaped to `mbit` by tc's token bucket. Yields the
    namespace's name. Needs root and iproute2. SIGTERM ends the run through the link's removal."""
    tag = f"{PREFIX}{os.getpid()}"
    here, there = f"{tag}h", f"{tag}e"
    _clear_the_address()
    # From before the namespace exists: a SIGTERM while the link is being made takes down what was made so far.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        try:
            for argv in (("ip", "netns", "add", tag), ("ip", "-n", tag, "link", "set", "lo", "up"),
                         ("ip", "link", "add", here, "type", "veth", "peer", "name", there),
                         ("ip", "link", "set", there, "netns", tag),
                         ("ip", "addr", "add", f"{LINK[0]}/30", "dev", here), ("ip", "link", "set", here, "up"),
                         ("ip", "-n", tag, "addr", "add", f"{LINK[1]}/30", "dev", there),
                         ("ip", "-n", tag, "link", "set", there, "up"),
                         ("tc", "qdisc", "add", "dev", here, "root", "tbf", "rate", f"{mbit}mbit", "burst", "4mb",
                          "latency", "100ms")):
                subprocess.run(argv, check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            why = exc.stderr.decode().strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
            raise SystemExit(f"cannot make the link (root and iproute2's ip and tc are needed): {why}") from exc
        yield tag
    finally:
        signal.signal(signal.SIGTERM, previous)
        _drop(tag)


def link_mb_s(namespace: str, nbytes: int) -> float:
    """MB/s of a plain TCP stream of `nbytes` over the link, from this side to a reader in the namespace."""
    listener = socket.create_server((LINK[0], 0))
    listener.settimeout(60)
    reader = subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, "-c",
                               "import socket, sys\n"
                               "s = socket.create_connection((sys.argv[1], int(sys.argv[2])))\n"
                               "while s.recv(1 << 22): pass\n",
                               LINK[0], str(listener.getsockname()[1])])
    conn, _ = listener.accept()
    block = bytearray(4 << 20)
    started = time.perf_counter()
    for _ in range(0, nbytes, len(block)):
        conn.sendall(block)
    conn.close()
    reader.wait(120)
    listener.close()
    return nbytes / (time.perf_counter() - started) / 1e6

"""Where a benchmark's bytes travel: the rate of plain TCP over loopback, or over a shaped link to a network
namespace that stands for another host (benchmarks/weight_sync.py --link-mbit)."""

from __future__ import annotations

import os
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


@contextmanager
def link(mbit: float) -> Iterator[str]:
    """A second network namespace for the explorers, joined to this one by a veth link whose direction towards
    them (chunks, as from a trainer on another host) is shaped to `mbit` by tc's token bucket. Yields the
    namespace's name. Needs root and iproute2."""
    tag = f"rlws{os.getpid() % 100000}"
    here, there = f"{tag}h", f"{tag}e"

    def drop() -> None:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", tag], capture_output=True)

    try:
        for argv in (("ip", "netns", "add", tag), ("ip", "-n", tag, "link", "set", "lo", "up"),
                     ("ip", "link", "add", here, "type", "veth", "peer", "name", there),
                     ("ip", "link", "set", there, "netns", tag), ("ip", "addr", "add", f"{LINK[0]}/30", "dev", here),
                     ("ip", "link", "set", here, "up"), ("ip", "-n", tag, "addr", "add", f"{LINK[1]}/30", "dev", there),
                     ("ip", "-n", tag, "link", "set", there, "up"),
                     ("tc", "qdisc", "add", "dev", here, "root", "tbf", "rate", f"{mbit}mbit", "burst", "4mb",
                      "latency", "100ms")):
            subprocess.run(argv, check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        drop()
        why = exc.stderr.decode().strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        raise SystemExit(f"cannot make the link (root and iproute2's ip and tc are needed): {why}") from exc
    try:
        yield tag
    finally:
        drop()


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

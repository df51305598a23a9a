"""The addresses a broker serves on: binding them, and `endpoints.json` in the buffer directory, written once
it serves.

Whoever starts a broker on port 0 (`rlbus up`, the benchmarks, the tests) learns its ports here. The file
names the broker's pid, so a file left by an earlier broker is never taken for the new one's.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import zmq

from rlbus.common import protocol as P
from rlbus.common.curve import load_server_auth
from rlbus.common.processes import Held, hold_lock
from rlbus.common.broker_config import BrokerConfig

NAME = "endpoints.json"
LOCK = "broker.lock"


class BindError(RuntimeError):
    """An address the broker was told to serve on cannot be bound (a port in use, an address not of this host)."""


class InUse(RuntimeError):
    """The buffer directory is another running broker's."""


def hold(buffer_dir: Path) -> IO[str]:
    """The buffer directory, this broker's alone while it runs (a second broker on it would write the same
    segments and catalogue); the open lock file, to keep."""
    try:
        return hold_lock(Path(buffer_dir) / LOCK)
    except Held as exc:
        raise InUse(f"{buffer_dir} is the buffer directory of a broker that runs (pid {exc.pid}); stop it, or "
                    "give this one another buffer.dir (or run.dir)") from None


def bind(sock: zmq.Socket, host: str, port: int) -> int:
    """Bind `sock` on TCP (port 0: a free port); returns the port."""
    try:
        return P.bind_tcp(sock, host, port)
    except zmq.ZMQError as exc:
        raise BindError(f"cannot serve on {P.tcp(host, port or '*')}: {exc.strerror}") from None


@dataclass
class Sockets:
    """The broker's two sockets, bound: ROUTER for requests, PUB for the weight-version bus."""

    router: zmq.Socket
    pub: zmq.Socket
    port: int
    pub_port: int
    auth: Any = None  # the CurveZMQ authenticator, when broker.curve_secret_key is set

    def close(self) -> None:
        self.router.close(0)
        self.pub.close(0)
        if self.auth is not None:
            self.auth.stop()


def open_sockets(ctx: zmq.Context, b: BrokerConfig) -> Sockets:
    """Both sockets set up and bound as `b` says; BindError (nothing left open) if an address cannot be bound."""
    router, pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PUB)
    for sock in (router, pub):
        sock.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.MAXMSGSIZE, 4 * b.max_message_bytes)
    router.setsockopt(zmq.ROUTER_MANDATORY, 0)
    router.setsockopt(zmq.SNDHWM, 0)
    router.setsockopt(zmq.RCVHWM, 0)
    sockets = Sockets(router, pub, 0, 0)
    if b.curve_secret_key:
        sockets.auth = load_server_auth(ctx, b.curve_secret_key, b.curve_authorized_dir, [router, pub])
    try:
        sockets.port = bind(router, b.host, b.port)
        sockets.pub_port = bind(pub, b.host, b.pub_port)
    except BindError:
        sockets.close()
        raise
    return sockets


def write(buffer_dir: Path, host: str, port: int, pub_port: int) -> None:
    path = Path(buffer_dir) / NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"router": P.tcp(host, port), "pub": P.tcp(host, pub_port),
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

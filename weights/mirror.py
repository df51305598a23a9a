"""A weight mirror: a host that follows the bus and serves the trainer's versions to explorers in its place.

The trainer's weight server sends each version once per explorer that fetches
it, from the trainer's own cores, and builds deltas there. A mirror fetches
each announced version once and serves it with a weight server of its own:
the trainer's cost no longer grows with the number of explorers, and the
deltas those explorers take are built on the mirror's host. By default it
takes whole versions, so the trainer builds no delta at all. Two explorers
fetching every version of the default model from a trainer that trains on
one core of a two-core host slowed its steps by 5-15%; through a mirror
taking whole versions, by -0.1% to +1.8% (serving took 0.9-2.8% of a step
of its CPU); through one taking deltas (`deltas`, for a mirror on a slow
link to the trainer), by 4.5-10% (benchmarks/trainer.py --serve).
Every chunk and the whole version are checked against the bus's digest, by
the mirror and again by each explorer, so a mirror can delay a version but
not change one. Explorers point `explorer.fetch_from` at it. A request for a
version newer than any the mirror holds waits for it (`await_s`), since an
explorer and the mirror hear of a version at the same moment.

    rlbus mirror [CONFIG] --broker ADDRESS --dir DIR [--host H] [--port P] [--advertise A] [--deltas]
"""

from __future__ import annotations

import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from rlbus.weights.checkpoint import version_dirs

log = structlog.get_logger()

AWAIT_S = 60.0  # how long a request for a version not here yet waits for it
RETRY_S = 2.0  # after a failed fetch, before asking again


class Mirror:
    """Follows the weight-version bus of the broker in `cfg`, fetches every newest version into `directory` and
    serves what it holds (the newest `keep`, so explorers still find the bases they take deltas against)."""

    def __init__(self, cfg, directory: str | Path, host: str = "127.0.0.1", port: int = 0, advertise: str = "",
                 keep: int = 3, fetch_timeout_s: float = 120.0, deltas: bool = False):
        """`deltas`: take deltas from the trainer when it has them ready, for a mirror on a slow link to it; off
        (the default), whole versions, and the trainer builds no delta at all (see the module docstring)."""
        from rlbus.weights.server import WeightServer

        if keep < 2:
            raise ValueError("a mirror keeps 2 or more versions (explorers take deltas against the one before)")
        s, b = cfg.sync, cfg.broker
        self.dir = Path(directory)
        self.keep = keep
        self.deltas = deltas
        self.fetch_timeout_s = fetch_timeout_s
        self.client_secret_file = b.curve_client_key
        curve = (b.curve_client_key, s.serve_authorized_dir or b.curve_authorized_dir) if b.curve_client_key else None
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(".v*.partial"):  # a fetch cut by a restart starts again (its chunks are few)
            shutil.rmtree(stale, ignore_errors=True)
        self.server = WeightServer(self.dir, host, port, advertise, chunk_bytes=int(s.serve_chunk_mb * (1 << 20)),
                                   curve=curve, deltas=s.serve_deltas, delta_priority=s.serve_delta_priority,
                                   map_files=True, await_s=AWAIT_S, settings="rlbus mirror --host, --port")
        self.held: tuple[int, str] | None = None  # (version, digest) of the newest version held
        for version, path in reversed(version_dirs(self.dir)):
            try:
                self.held = (version, self.server.add(version, None))
                break
            except FileNotFoundError:
                continue
        self._announced: queue.Queue = queue.Queue()
        self._cfg = cfg
        self.fetched = 0
        self._whole_s: float | None = None  # how long the last whole version took: the wait for a delta

    @property
    def address(self) -> str:
        return self.server.address

    def run(self, stop: threading.Event, connect_timeout_s: float = 60.0) -> None:
        """Serve, and fetch each newest announced version, until `stop` is set (at once: a fetch under way is
        dropped, and its chunks with it)."""
        from rlbus.common.client import BrokerClient, default_name

        b = self._cfg.broker
        client = BrokerClient(b.address, "tool", default_name("mirror"), bus_address=self._cfg.bus_address(),
                              curve_server_key=b.curve_server_key, curve_client_key=b.curve_client_key,
                              on_weights=self._announced.put)
        self.server.start()
        try:
            client.start(connect_timeout_s)
            log.info("mirror_started", address=self.address, public_key=self.server.public_key or None,
                     dir=str(self.dir), held=self.held[0] if self.held else None)
            threading.Thread(target=self._follow, args=(stop,), name="mirror-follow", daemon=True).start()
            while not stop.wait(0.5):  # a signal's handler runs in this thread: never blocked without a timeout
                pass
        finally:
            client.close(bye=True)
            self.server.close()

    def _follow(self, stop: threading.Event) -> None:
        state, handled, retry_at = None, None, 0.0
        while not stop.is_set():
            try:
                state = self._announced.get(timeout=0.2)
                while not self._announced.empty():  # only the newest matters
                    state = self._announced.get_nowait()
            except queue.Empty:
                pass
            if state is None or (state["version"], state["digest"]) == handled or time.monotonic() < retry_at:
                continue
            try:
                if not self._wanted(state) or self._fetch(state):
                    handled = (state["version"], state["digest"])
                    continue
            except Exception:  # a bug or a full disk costs this version, never the mirror
                log.exception("mirror_fetch_failed", policy_version=state["version"])
            retry_at = time.monotonic() + RETRY_S

    def _wanted(self, state: dict[str, Any]) -> bool:
        """A version newer than the one held, or one held under the same number with other bytes (the version
        of a new run, whose trainer started again from its first versions)."""
        from rlbus.weights.digest import matches

        if not state.get("fetch_from") or state["fetch_from"] == self.address:
            return False
        if self.held is None or state["version"] > self.held[0]:
            return True
        path = self.dir / f"v{state['version']}"
        return not (path.is_dir() and matches(path, state["digest"])[0])

    def _fetch(self, state: dict[str, Any]) -> bool:
        from rlbus.weights.fetch import Base, DeltaFailed, FetchFailed, fetch_version

        version = state["version"]
        base = Base(self.held[0], self.dir / f"v{self.held[0]}", self.held[1]) if self.held and self.deltas else None

        def fetch(against):
            return fetch_version(state["fetch_from"], version, state["digest"], self.dir, against,
                                 server_key=state.get("fetch_key", ""), client_secret_file=self.client_secret_file,
                                 timeout_s=self.fetch_timeout_s, delta_wait_s=self._whole_s)

        try:
            try:
                got = fetch(base)
            except DeltaFailed as exc:
                log.warning("weights_delta_failed", policy_version=version, error=str(exc)[:300])
                got = fetch(None)
        except (FetchFailed, OSError) as exc:
            log.warning("weights_fetch_failed", policy_version=version, error=str(exc)[:300], retry_in_s=RETRY_S)
            return False
        if got.base is None and got.received_bytes:  # as an explorer's receiver: wait for a delta no longer
            self._whole_s = got.seconds - got.manifest_s  # than the whole version takes (weights/sync.py)
        self.held = (version, self.server.add(version, self.held))
        self.fetched += 1
        log.info("weights_fetched", policy_version=version, base=got.base, bytes=got.received_bytes,
                 version_bytes=got.version_bytes, seconds=round(got.seconds, 3))
        # The newest `keep` up to this one; any above it are from before the trainer started again.
        held = version_dirs(self.dir)
        for _, path in [d for d in held if d[0] > version] + [d for d in held if d[0] <= version][:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)
        return True


def run(cfg, directory: str | Path, host: str, port: int, advertise: str, keep: int, deltas: bool = False) -> None:
    """`rlbus mirror`: until SIGTERM, SIGINT or SIGHUP."""
    from rlbus.common.processes import on_stop_signals

    stop = threading.Event()
    on_stop_signals(stop.set)
    mirror = Mirror(cfg, directory, host, port, advertise, keep, cfg.explorer.fetch_timeout_s, deltas)
    print(mirror.address, flush=True)
    mirror.run(stop)

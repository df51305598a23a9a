"""Weight sync behind one interface: a sender in the trainer, a receiver in each explorer, one pair per method.

Sender (trainer): `attach(client)` once connected, `snapshot(model)` on the
training thread (one copy, so training goes on), `publish(snapshot, version,
step)` on the publishing thread (returns the weight state for PUBLISH),
`close()`. `make_sender` picks the pair by `sync.sync_method`:

    checkpoint   CheckpointSender (checkpoint.py)   weights/v{N}/ on disk, read by path
    nccl         BroadcastSender  (broadcaster.py)  a broadcast to the epoch's members, plus the checkpoint

and, with `sync.serve` (the default), starts the third pair's sender: a
WeightServer (server.py) over the checkpoint directory, whose address every
state announces as `fetch_from`; its receiver is `fetch_version` (fetch.py).

Receiver (explorer): `Receiver.load(engine, state)` brings the engine to the
announced version with one call. It chooses a *source*: the broadcast when
this explorer is a member of the announced epoch (and did not fail that
version), else the checkpoint directory when this host can read it, else a
fetch from the weight server into a local directory (deltas against the
version held), whose digest it checks first either way. An engine that
waits for its weights anyway (`overlaps_fetch`) reloads while a fetch
arrives, from a `stream` source (stream.py); a fetch that fails puts it
back on the version it held. A source is a small
picklable map; the engine hands it to its workers, where `open_source` turns
it into an iterator of (name, tensor) that the engine reloads from. The
engine knows nothing else about weight sync.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterator, Protocol

import structlog

from rlbus.weights.checkpoint import version_dirs
from rlbus.weights.digest import matches, weights_digest

log = structlog.get_logger()


class DigestMismatch(Exception):
    """Weights on disk are not the ones the bus announced."""


class Sender(Protocol):
    method: str

    def attach(self, client) -> None: ...
    def snapshot(self, model) -> Any: ...
    def publish(self, snapshot: Any, version: int, step: int) -> dict[str, Any]: ...
    def close(self) -> None: ...


class Engine(Protocol):
    """What a receiver needs of an engine: its version, and a reload from a source."""

    version: int

    def reload(self, source: dict[str, Any], version: int) -> dict[str, Any]: ...


def make_sender(cfg, weights_dir: str | Path, base_model_dir: str | Path, device: str = "cpu") -> Sender:
    """The trainer's sender for `cfg.sync.sync_method`, publishing in `cfg.rollout.dtype` (as this host resolves
    `auto`)."""
    import torch

    from rlbus.weights.checkpoint import CheckpointSender
    from rlbus.weights.models import rollout_dtype

    dtype = getattr(torch, rollout_dtype(cfg.rollout.dtype))
    checkpoint = CheckpointSender(weights_dir, base_model_dir, dtype=dtype, server=make_server(cfg, weights_dir))
    if cfg.sync.sync_method == "nccl":
        from rlbus.weights.broadcaster import BroadcastSender

        return BroadcastSender(cfg, checkpoint, dtype=dtype, device=device)
    return checkpoint


def make_server(cfg, weights_dir: str | Path):
    """The trainer's weight server over `weights_dir` (`sync.serve`), started; None when serving is off."""
    s, b = cfg.sync, cfg.broker
    if not s.serve:
        return None
    from rlbus.weights.server import WeightServer

    curve = None
    if b.curve_client_key:  # the trainer's own key pair makes it a CURVE server; clients learn its key on the bus
        curve = (b.curve_client_key, s.serve_authorized_dir or b.curve_authorized_dir)
    return WeightServer(weights_dir, s.serve_host, s.serve_port, s.serve_advertise,
                        chunk_bytes=int(s.serve_chunk_mb * (1 << 20)), curve=curve, deltas=s.serve_deltas,
                        delta_priority=s.serve_delta_priority, map_files=True).start()


def checkpoint_source(path: str | Path) -> dict[str, Any]:
    return {"method": "checkpoint", "path": str(path)}


def stream_source(progress: str | Path, timeout_s: float, path: str | Path) -> dict[str, Any]:
    """A version being fetched: `progress` tells what of it is in place (weights/stream.py), `path` is where it
    will be."""
    return {"method": "stream", "progress": str(progress), "timeout_s": timeout_s, "path": str(path)}


def broadcast_source(announcement: dict[str, Any], rank: int) -> dict[str, Any]:
    return {"method": "nccl", "announcement": announcement, "rank": rank}


def load_checkpoint(engine: Engine, path: str | Path, digest: str, version: int) -> dict[str, Any]:
    """Load published weights by path into the engine, after checking their digest."""
    if digest:
        ok, actual = matches(path, digest)
        if not ok:
            raise DigestMismatch(f"weights at {path} have digest {actual}, the bus announced {digest}")
    return engine.reload(checkpoint_source(path), version)


RETRY_S = 2.0  # a fetch that failed is tried again after this long


class Receiver:
    """An explorer's side of weight sync, for any method (see the module docstring).

    `mode` is `explorer.receive`: auto (broadcast when a member, else the announced directory when this host can
    read it, else a fetch), checkpoint (no broadcast), fetch (always fetch). Fetched versions are kept under
    `fetch_dir`; the version held as files is the base that the next fetch takes deltas against.
    """

    def __init__(self, name: str, fetch_dir: str | Path | None = None, mode: str = "auto",
                 fetch_timeout_s: float = 120.0, client_secret_file: str = "", overlap: bool = True,
                 delta_wait_s: float | None = None, fetch_from: str = "", fetch_key: str = ""):
        self.name = name
        # A weight server to fetch from in place of the announced one (a mirror), and its CurveZMQ key.
        self.fetch_from, self.fetch_key = fetch_from, fetch_key
        self.mode = mode
        self.overlap = overlap  # reload while a fetch arrives, into an engine that says it may (`overlaps_fetch`)
        self.fetch_dir = Path(fetch_dir) if fetch_dir else None
        self.fetch_timeout_s = fetch_timeout_s
        self.client_secret_file = client_secret_file
        self.failed: set[int] = set()  # versions whose broadcast failed here: they come by checkpoint or fetch
        self.held = None  # fetch.Base of the version the engine holds, when it is held as files
        self._retry_at: dict[int, float] = {}  # version -> when a failed fetch of it may be tried again
        self._warmer = None  # fetch.SpareWarmer writing a spare for the next fetch, until that fetch starts
        self.delta_wait_s = delta_wait_s  # how long to wait for a delta's build; None: as long as `_whole_s`
        self._whole_s = None  # how long the last whole version took to arrive

    def load(self, engine: Engine, state: dict[str, Any] | None) -> bool:
        """Bring `engine` to the version of the weight state `state`; True if it loaded it."""
        if not state or state["version"] <= engine.version:
            return False
        ann = state.get("broadcast")
        if ann and self.name in ann["ranks"] and ann["version"] not in self.failed:
            try:
                engine.reload(broadcast_source(ann, ann["ranks"][self.name]), ann["version"])
                self.held = None
                return True
            except Exception as exc:  # the trainer aborts the epoch; this version comes by checkpoint or fetch
                self.failed.add(ann["version"])
                log.warning("broadcast_failed", policy_version=ann["version"], epoch=ann["epoch"],
                            error=str(exc)[:300])
        location = state.get("location")
        if not location:
            return False  # announced by broadcast only so far: its checkpoint follows
        if self.mode != "fetch" and Path(location).is_dir():
            try:
                load_checkpoint(engine, location, state["digest"], state["version"])
                self._hold(state, Path(location))
                return True
            except (DigestMismatch, FileNotFoundError) as exc:
                log.warning("weights_path_unusable", policy_version=state["version"], location=location,
                            error=str(exc), fetch=bool(state.get("fetch_from")))
        if self.fetch_from:
            state = {**state, "fetch_from": self.fetch_from, "fetch_key": self.fetch_key}
        if state.get("fetch_from") and self.fetch_dir is not None:
            return self._fetch(engine, state)
        log.error("weights_unreachable", policy_version=state["version"], location=location,
                  reason="the directory is not readable here and no weight server is announced")
        return False

    def _hold(self, state: dict[str, Any], path: Path) -> None:
        from rlbus.weights.fetch import Base

        self.held = Base(state["version"], path, state["digest"])

    def _fetch(self, engine: Engine, state: dict[str, Any]) -> bool:
        from rlbus.weights.fetch import DeltaFailed, FetchFailed, SpareWarmer, fetch_version, retire

        version = state["version"]
        if time.monotonic() < self._retry_at.get(version, 0.0):
            return False  # it failed a moment ago: the caller asks again, the server is not flooded
        base = self.held or self._kept()

        def fetch(against, progress=None):
            return fetch_version(state["fetch_from"], version, state["digest"], self.fetch_dir, against,
                                 server_key=state.get("fetch_key", ""), client_secret_file=self.client_secret_file,
                                 timeout_s=self.fetch_timeout_s, progress=progress,
                                 delta_wait_s=self._whole_s if self.delta_wait_s is None else self.delta_wait_s)

        self._stop_warmer()  # what it wrote so far is the spare this fetch writes over
        got, loaded, failed, held = None, False, None, self.held
        overlapped = self.overlap and getattr(engine, "overlaps_fetch", False) and held is not None \
            and held.version == engine.version and held.path.parent == self.fetch_dir
        if overlapped:
            got, loaded, failed = self._overlapped(engine, version, held, fetch)
        if got is None:
            try:
                try:
                    if isinstance(failed, DeltaFailed):
                        raise failed
                    got = fetch(base)
                except DeltaFailed as exc:
                    log.warning("weights_delta_failed", policy_version=version, base=base.version,
                                error=str(exc)[:300])
                    got = fetch(None)
            except (FetchFailed, OSError) as exc:
                self._retry_at[version] = time.monotonic() + RETRY_S
                log.warning("weights_fetch_failed", policy_version=version, error=str(exc)[:300],
                            retry_in_s=RETRY_S)
                if overlapped:  # the engine reloaded part (or all) of a version that did not arrive: go back
                    engine.reload(checkpoint_source(held.path), held.version)
                return False
        log.info("weights_fetched", policy_version=version, base=got.base, bytes=got.received_bytes,
                 version_bytes=got.version_bytes, seconds=round(got.seconds, 3), apply_s=round(got.apply_s, 3),
                 bad_chunks=got.bad_chunks, resent=got.resent, overlapped=loaded)
        if got.base is None and got.received_bytes:  # not counting a wait for a delta that did not come
            self._whole_s = got.seconds - got.manifest_s
        if not loaded:
            engine.reload(checkpoint_source(got.path), version)  # fetch_version checked the digest
        self._hold(state, got.path)
        if not retire(self.fetch_dir, keep=got.path):  # none older to write the next one over: write one
            self._warmer = SpareWarmer(self.fetch_dir, got.path)
        return True

    def _overlapped(self, engine: Engine, version: int, held, fetch) -> tuple[Any, bool, Exception | None]:
        """Fetch `version` while the engine reloads from what has arrived (weights/stream.py). Returns the fetched
        version (None when the fetch failed), whether the engine loaded it, and the fetch's error. When it did not
        load, the engine may hold part of the version: the caller loads one in full."""
        from rlbus.weights.fetch import FetchFailed
        from rlbus.weights.stream import StreamProgress

        progress = StreamProgress(self.fetch_dir / f".v{version}.stream")
        progress.remove()  # left by an earlier attempt at this version
        # The worker gives up a little after the fetch would (its own timeout), so a reload never outlives it.
        source = stream_source(progress.path, self.fetch_timeout_s + 10, self.fetch_dir / f"v{version}")
        outcome: dict[str, Exception] = {}

        def reload():
            try:
                engine.reload(source, version)
            except Exception as exc:  # told below; the caller reloads from the files
                outcome["reload"] = exc

        loader = threading.Thread(target=reload, name="stream-reload", daemon=True)
        loader.start()
        got, failed = None, None
        try:
            got = fetch(held, progress)
        except Exception as exc:
            failed = exc
            progress.fail(f"{type(exc).__name__}: {exc}")
        finally:
            loader.join()
            progress.remove()
        if "reload" in outcome and got is not None:
            log.warning("weights_stream_reload_failed", policy_version=version, error=str(outcome["reload"])[:300])
        if failed is not None and not isinstance(failed, (FetchFailed, OSError)):
            engine.reload(checkpoint_source(held.path), held.version)
            raise failed
        return got, got is not None and "reload" not in outcome, failed

    def close(self) -> None:
        """Stop writing a spare, if one is being written (at once: what was written stays usable)."""
        self._stop_warmer()

    def _stop_warmer(self) -> None:
        if self._warmer is not None:
            self._warmer.stop()
            self._warmer = None

    def _kept(self):
        """After a restart: the newest version fetched before, as a delta base (the server checks its digest)."""
        from rlbus.weights.fetch import Base

        for version, path in reversed(version_dirs(self.fetch_dir)):
            try:
                return Base(version, path, weights_digest(path))
            except FileNotFoundError:
                continue
        return None


def open_source(source: dict[str, Any], worker: Any) -> tuple[Iterator[tuple[str, Any]], dict[str, Any]]:
    """Inside an engine worker: the tensors of `source`, and a map the opener fills with what it measured.

    A broadcast member keeps its place in the epoch on `worker` between versions (see
    `broadcast.receive_version`); the tensors it returns are views of the received buckets, checked
    against the announced digest before any is handed out.
    """
    info: dict[str, Any] = {}
    if source["method"] == "checkpoint":
        from rlbus.weights.checkpoint import checkpoint_tensors

        return checkpoint_tensors(source["path"], info), info
    if source["method"] == "stream":
        from rlbus.weights.stream import streamed_tensors

        return streamed_tensors(source["progress"], source["timeout_s"], info), info
    if source["method"] == "nccl":
        from rlbus.weights.broadcast import receive_version

        # An engine with several workers (tensor parallel) has a rank per worker, from the explorer's first one.
        rank = source["rank"] + getattr(worker, "rank", 0)
        return receive_version(worker, source["announcement"], rank, info), info
    raise ValueError(f"unknown weight source {source.get('method')!r}")

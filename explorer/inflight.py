"""In-flight weight updates for a streaming explorer: the loader thread and the engine as it sees it.

A `Loader` watches the weight bus and, once the newest announced version is
`explorer.swap_lag` versions ahead of the engine's, brings it into the
running engine through the explorer's receiver, which fetches it while
generation goes on; the engine pauses only for the swap itself, and
(unless the source is a broadcast, which all its members load together)
only inside a swap slot the broker grants (`sync.max_swapping`).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from typing import TYPE_CHECKING, Iterator

import structlog

from rlbus.common import protocol as P
from rlbus.common.client import BrokerError, BrokerUnreachable
from rlbus.weights.sync import RETRY_S

if TYPE_CHECKING:
    from rlbus.explorer.main import Explorer

log = structlog.get_logger()


class Stopping(Exception):
    """The explorer is stopping: a load not begun yet is given up."""


class Loader:
    """Streaming with in-flight updates: a thread that loads each newly announced version into the running
    engine (the receiver fetches it meanwhile; the engine pauses only for the swap, inside a swap slot)."""

    def __init__(self, explorer: Explorer):
        self.explorer = explorer
        self._stop = threading.Event()
        # In the explorer's logging context (its peer name): a new thread would start with an empty one.
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run,), name="weights-loader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ex = self.explorer
        engine = _Slotted(ex)
        while not self._stop.is_set():
            state = ex.client.weights or {}
            lag = 1 if state.get("method") == "nccl" else ex.cfg.explorer.swap_lag  # every epoch's members load
            if state.get("version", 0) >= ex.engine.version + lag:
                try:
                    ex._load_newest(engine)
                except Stopping:
                    return
                except Exception:
                    log.exception("weights_load_failed", version=state.get("version"))
                    self._stop.wait(RETRY_S)
                    continue
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _Slotted:
    """The engine as the loader's receiver sees it: every swap (but a broadcast's, which all members of the
    epoch load together) happens inside a swap slot."""

    def __init__(self, explorer: Explorer):
        self.explorer = explorer

    @property
    def version(self) -> int:
        return self.explorer.engine.version

    def reload(self, source: dict, version: int) -> dict:
        if source["method"] == "nccl":
            return self.explorer.engine.reload(source, version)
        with swap_slot(self.explorer, version):
            return self.explorer.engine.reload(source, version)


@contextlib.contextmanager
def swap_slot(explorer: Explorer, version: int) -> Iterator[None]:
    """Hold one of the run's `sync.max_swapping` swap slots (the broker grants them) while inside."""
    if not explorer.welcome_sync.get("max_swapping"):
        yield
        return
    started = time.monotonic()
    while True:
        reply = explorer.client.request(P.SWAP, {"phase": "begin", "version": version}, timeout=None)
        if reply.command == P.OK:
            break
        if explorer.stop_event.wait(reply.header["retry_after_s"]):
            raise Stopping("stopped while waiting for a swap slot")
    waited = time.monotonic() - started
    if waited > 0.01:
        log.info("swap_slot_waited", policy_version=version, waited_s=round(waited, 3))
    try:
        yield
    finally:
        try:
            explorer.client.request(P.SWAP, {"phase": "end", "version": version}, timeout=30)
        except (BrokerError, BrokerUnreachable, TimeoutError) as exc:  # the broker frees it when its time is up
            log.warning("swap_slot_not_released", error=str(exc))

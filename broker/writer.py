"""The broker's writer: group commits off the event loop, in a two-stage pipeline.

The loop plans each group commit (`Store.prepare`) and queues it here. The
appending thread writes its payloads where they were placed and checksums
them (`Store.append`); the recording thread syncs everything appended so far
and commits the metadata (`Store.record`), then tells the loop over an
inproc socket, which ACKs. The two overlap: commit N+1 is copied into the
page cache while commit N waits on the disk. os.pwritev, zlib.crc32,
fdatasync and SQLite all release the GIL, so receiving and answering go on
meanwhile, and whatever queued up becomes the next, larger group commit.

A failed sync may have dropped any page written before it returned, so it
fails every commit appended by then, not only the one it was syncing;
nothing is ACKed that a later, successful sync does not cover.
"""

from __future__ import annotations

import queue
import threading
from typing import TypeVar

import structlog
import zmq

from rlbus.broker.store import Store, WriteJob

log = structlog.get_logger()

T = TypeVar("T")


class Writer:
    def __init__(self, store: Store, ctx: zmq.Context):
        self.store = store
        self.address = f"inproc://rlbus-writer-{id(self)}"
        self.done = ctx.socket(zmq.PULL)
        self.done.bind(self.address)
        self._ctx = ctx
        self._queue: queue.Queue[WriteJob | None] = queue.Queue()
        self._appended: queue.Queue[tuple[int, list[WriteJob]] | None] = queue.Queue()
        self._started = 0  # group commits the appending thread has begun to write
        self._jobs: dict[int, WriteJob] = {}
        self._next = 0
        self._threads = [threading.Thread(target=self._append_loop, name="rlbus-writer-append", daemon=True),
                         threading.Thread(target=self._record_loop, name="rlbus-writer-record", daemon=True)]
        for thread in self._threads:
            thread.start()

    def submit(self, job: WriteJob) -> int:
        """Queue a job; returns its number, which `done` will carry once it is durable."""
        self._next += 1
        self._jobs[self._next] = job
        self._queue.put(job)
        job.number = self._next
        return self._next

    def completed(self) -> list[tuple[WriteJob, str | None]]:
        """Jobs finished since the last call, each with an error message or None."""
        out = []
        while self.done.poll(0):
            number, _, error = self.done.recv().decode().partition(":")
            out.append((self._jobs.pop(int(number)), error or None))
        return out

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    def _append_loop(self) -> None:
        notify = self._notifier()
        try:
            while (jobs := _drain(self._queue)) is not None:
                self._started += 1
                try:
                    self.store.append(jobs)
                except Exception as exc:  # disk full, I/O error: the loop refuses these PUTs, stays up
                    _report(notify, jobs, exc)
                    continue
                self._appended.put((self._started, jobs))
        finally:
            self._appended.put(None)
            notify.close(0)

    def _record_loop(self) -> None:
        notify = self._notifier()
        failed_through, failure = 0, ""  # commits appended before the last failed sync, and its error
        try:
            while (batches := _drain(self._appended)) is not None:
                lost = [job for seq, jobs in batches if seq <= failed_through for job in jobs]
                if lost:
                    _report(notify, lost, failure)
                jobs = [job for seq, jobs in batches if seq > failed_through for job in jobs]
                if not jobs:
                    continue
                try:
                    self.store.record(jobs)
                except Exception as exc:
                    failed_through, failure = self._started, exc
                    _report(notify, jobs, exc)
                    continue
                _report(notify, jobs, None)
        finally:
            notify.close(0)

    def _notifier(self) -> zmq.Socket:
        notify = self._ctx.socket(zmq.PUSH)
        notify.connect(self.address)
        return notify

    def stop(self, timeout: float = 30.0) -> None:
        """Finish queued jobs and end both threads; `completed` still reports them."""
        self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout)


def _drain(q: queue.Queue[T | None]) -> list[T] | None:
    """Wait for one item, then take every item already queued; None once the queue is closed."""
    first = q.get()
    if first is None:
        return None
    items = [first]
    while True:
        try:
            more = q.get_nowait()
        except queue.Empty:
            return items
        if more is None:
            q.put(None)  # seen again by the next call, after these items are handled
            return items
        items.append(more)


def _report(notify: zmq.Socket, jobs: list[WriteJob], error: Exception | str | None) -> None:
    message = ""
    if error is not None:
        log.error("store_write_failed", error=str(error), jobs=len(jobs))
        message = str(error).replace(":", " ")[:200] or type(error).__name__
    for job in jobs:
        notify.send(f"{job.number}:{message}".encode())

"""The broker's writer thread: group commits off the event loop.

The loop plans each group commit (`Store.prepare`) and queues it here; this
thread appends the payloads, fsyncs them, commits their metadata, and then
tells the loop over an inproc socket, which ACKs. os.write, fdatasync and
SQLite all release the GIL, so receiving and answering go on while the disk
works, and whatever queued up meanwhile becomes the next, larger group commit.
"""

from __future__ import annotations

import queue
import threading
import uuid

import structlog
import zmq

from rlbus.broker.store import Store, WriteJob
from rlbus.common.processes import name_os_thread

log = structlog.get_logger()


class Writer:
    def __init__(self, store: Store, ctx: zmq.Context):
        self.store = store
        self.address = f"inproc://rlbus-writer-{uuid.uuid4().hex}"  # not id(): see BrokerClient's wake address
        self.done = ctx.socket(zmq.PULL)
        self.done.bind(self.address)
        self._ctx = ctx
        self._queue: queue.Queue[WriteJob | None] = queue.Queue()
        self._jobs: dict[int, WriteJob] = {}
        self._next = 0
        self._thread = threading.Thread(target=self._run, name="rlbus-writer", daemon=True)
        self._thread.start()

    def submit(self, job: WriteJob) -> int:
        """Queue a job; returns its number, which `done` will carry once it is durable."""
        self._next += 1
        self._jobs[self._next] = job
        job.number = self._next  # before the writer thread can see it: it reports the job by this number
        self._queue.put(job)
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

    def _run(self) -> None:
        name_os_thread("rlbus-writer")
        notify = self._ctx.socket(zmq.PUSH)
        notify.connect(self.address)
        try:
            while True:
                job = self._queue.get()
                if job is None:
                    return
                jobs = [job]
                while True:
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        self._queue.put(None)
                        break
                    jobs.append(more)
                error = ""
                try:
                    self.store.write(jobs)
                except Exception as exc:  # disk full, I/O error: the loop refuses these PUTs, stays up
                    log.error("store_write_failed", error=str(exc), jobs=len(jobs))
                    error = str(exc).replace(":", " ")[:200] or type(exc).__name__
                for j in jobs:
                    notify.send(f"{j.number}:{error}".encode())
        finally:
            notify.close(0)

    def stop(self, timeout: float = 30.0) -> None:
        """Finish queued jobs and end the thread; `completed` still reports them."""
        self._queue.put(None)
        self._thread.join(timeout)

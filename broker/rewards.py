"""Routing evaluation requests to reward workers (the Majordomo pattern).

A reward worker says HELLO with role `reward` and the services it offers in
`capabilities.services` (e.g. `math`, `code`, `rm`). An explorer sends
`EVAL {service, items}`; the broker turns it into a job, gives it to the
worker offering that service with the fewest jobs in hand, and forwards the
worker's `RESULT` to the explorer as the reply. A job whose worker is dropped,
does not answer within `reward.eval_timeout_s`, or answers with what is not one
finite score per item (the worker gets `ERROR bad_field`) goes to another
worker, at most `reward.eval_attempts` times in all; after that, or when no
worker offers the service, the explorer gets an ERROR that says so.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import structlog

from rlbus.broker.peers import Peer, Peers
from rlbus.common import protocol as P
from rlbus.common.messages import Scores

log = structlog.get_logger()


@dataclass
class Job:
    id: int
    client: bytes
    msg: P.Message
    service: str
    attempts: int = 0
    worker: str = ""
    deadline: float = 0.0
    last_error: str = ""  # why the last attempt gave no result


class RewardRouter:
    def __init__(self, peers: Peers, send: Callable[[bytes, list[bytes]], None], timeout_s: float, attempts: int):
        self.peers = peers
        self.send = send
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.jobs: dict[int, Job] = {}
        self._ids = itertools.count(1)

    def services(self) -> dict[str, list[Peer]]:
        out: dict[str, list[Peer]] = {}
        for peer in self.peers:
            if peer.role == "reward":
                for service in peer.info.get("capabilities", {}).get("services", []):
                    out.setdefault(service, []).append(peer)
        return out

    def _reply(self, job: Job, command: str, header: dict[str, Any]) -> None:
        if "req" in job.msg.header:
            header["req"] = job.msg.header["req"]
        self.send(job.client, P.encode(command, header))

    def _fail(self, job: Job, code: str, message: str) -> None:
        self.jobs.pop(job.id, None)
        log.warning("eval_failed", job=job.id, service=job.service, code=code, reason=message)
        self._reply(job, P.ERROR, {"code": code, "message": message})

    def _dispatch(self, job: Job, exclude: str = "") -> None:
        offered = self.services()
        workers = [w for w in offered.get(job.service, []) if w.name != exclude] or offered.get(job.service, [])
        if not workers:
            known = sorted(offered) or "none"
            return self._fail(job, "no_service", f"no reward worker offers service {job.service!r} "
                                                 f"(services offered now: {known}); start `rlbus reward` with it")
        if job.attempts >= self.attempts:
            return self._fail(job, "eval_failed", f"service {job.service!r}: no result after {job.attempts} "
                                                  f"attempts (the last: {job.last_error})")
        load = {w.name: 0 for w in workers}
        for other in self.jobs.values():
            if other.worker in load:
                load[other.worker] += 1
        worker = min(workers, key=lambda w: load[w.name])
        job.attempts += 1
        job.worker = worker.name
        job.deadline = time.time() + self.timeout_s
        self.send(worker.identity, P.encode(P.EVAL, {"job": job.id, "service": job.service,
                                                     "items": job.msg.header["items"]}))
        log.info("eval_routed", job=job.id, service=job.service, worker=worker.name, attempt=job.attempts,
                 items=len(job.msg.header["items"]))

    def submit(self, client: bytes, msg: P.Message) -> None:
        job = Job(next(self._ids), client, msg, msg.header["service"])
        self.jobs[job.id] = job
        self._dispatch(job)

    def result(self, worker: Peer, msg: P.Message) -> None:
        job = self.jobs.get(msg.header["job"])
        if job is None:
            return  # answered already by another worker, or failed
        results, items = msg.header["results"], len(job.msg.header["items"])
        try:
            msgspec.convert(msg.header, Scores)
            if len(results) != items:
                raise P.ProtocolError("bad_field", f"RESULT: {len(results)} results for {items} items")
        except msgspec.ValidationError as exc:
            return self._refused(worker, job, P.field_error("RESULT", exc))
        except P.ProtocolError as exc:
            return self._refused(worker, job, exc)
        del self.jobs[job.id]
        self._reply(job, P.RESULT, {"job": job.id, "results": msg.header["results"], "served_by": worker.name})

    def _refused(self, worker: Peer, job: Job, exc: P.ProtocolError) -> None:
        """A worker's answer that is not one finite score per item: told so, and the job goes elsewhere."""
        log.warning("eval_answer_refused", job=job.id, service=job.service, worker=worker.name, reason=exc.message)
        self.send(worker.identity, P.error(exc.code, exc.message))
        if worker.name == job.worker:  # not a late answer of an earlier attempt: the job's current one failed
            job.last_error = f"worker {worker.name}: {exc.message}"
            self._dispatch(job, exclude=worker.name)

    def worker_gone(self, peer: Peer) -> None:
        for job in [j for j in self.jobs.values() if j.worker == peer.name]:
            log.info("eval_rerouted", job=job.id, service=job.service, lost_worker=peer.name)
            job.last_error = f"worker {peer.name} was dropped"
            self._dispatch(job, exclude=peer.name)

    def client_gone(self, peer: Peer) -> None:
        for job in [j for j in self.jobs.values() if j.client == peer.identity]:
            del self.jobs[job.id]

    def tick(self, now: float) -> None:
        for job in [j for j in self.jobs.values() if j.deadline <= now]:
            log.warning("eval_timed_out", job=job.id, service=job.service, worker=job.worker)
            job.last_error = f"worker {job.worker} did not answer within {self.timeout_s} s"
            self._dispatch(job, exclude=job.worker)

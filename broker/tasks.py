"""Task leases: which explorer is rolling out which task, and until when.

Tasks are numbered in the order they are first issued (`seq`); task seq s
belongs to explorer batch ⌊s / batch_tasks⌋. A lease names a task and a
holder and expires; a lease that expires or whose holder is dropped returns
its task to the queue, and the next LEASE gets it again (lowest seq first, so
an old batch is finished before a new one starts). A task is done when a
group answering any of its leases is stored. A holder dropped for silence
(a stalled process, a network gap) may still be rolling its tasks out: when
it says HELLO again with the same session, the leases it lost that nobody
has taken since are its again (`restore`), so its tasks are not done twice.

Revisits (`data.revisit`, a share of each batch): a task whose group was
informative (its rewards differed: the policy solves it sometimes) is
queued to be issued again, as a new seq in a later batch (not the next one),
up to `data.revisit_times` times; the last slots of each batch take queued
tasks first, oldest first. Every other seq takes the taskset's next task, so
the taskset is read in order whatever the revisits, and the run's tasks end
with the taskset's (revisits still waiting then are not issued).

Leases live in the broker's catalogue (`catalog.py`), so a restarted broker knows which
tasks were issued, which are done and which are still out. A lease is recorded
before it is granted, and a disk error grants none; a task done or a lease
given back is made in memory even when the disk refuses its record (`_behind`).
"""

from __future__ import annotations

import bisect
import heapq
import re
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable

import structlog

from rlbus.broker.catalog import DISK_ERRORS, Catalog
from rlbus.common.tasksets import Taskset

log = structlog.get_logger()


@dataclass(slots=True)
class Lease:
    lease_id: str
    seq: int
    holder: str
    expires: float
    req: int | None = None  # the LEASE request that granted it: a resend of that request gets it again
    session: str | None = None  # its holder's HELLO session: another process under the name cannot know it


def refusal(sync, batch_index: int, version: int, trainer_step: int, queued_steps: int,
            next_step: int | None = None) -> tuple[str, int] | None:
    """Why an explorer holding `version` may not generate `batch_index` now, or None (admission control).

    ("version", need): its weights are too old; it must load `need` first
    (lockstep: batch e needs max(0, floor((e - O)/I)*I); every style: no more
    than max_staleness behind the trainer's step). ("ahead", 0), async only:
    data generated now would be staler than max_staleness by the time the
    trainer reaches it, `queued_steps` of data being queued or leased ahead;
    newer weights would not help, so it backs off until the trainer catches up.
    `next_step` is the first step that can still take new data (the trainer's
    step, or the one after it once that step's batch is delivered): data made
    now is trained at `next_step + queued_steps` at the earliest.
    """
    floor = max(0, trainer_step - sync.max_staleness)
    if sync.sync_style == "lockstep":
        need = max(sync.required_version(batch_index), floor)
        return None if version >= need else ("version", need)
    if version < floor:
        return "version", floor
    first = trainer_step if next_step is None else next_step
    return ("ahead", 0) if first + queued_steps - version > sync.max_staleness else None


_LEASE_ID = re.compile(r"t([0-9]{1,15})\.[0-9]{1,15}", re.ASCII)  # ASCII digits only: int() must agree


def lease_id(seq: int, attempt: int) -> str:
    return f"t{seq}.{attempt}"


def seq_of(lease: str) -> int | None:
    """The task seq a lease (group) id answers, or None for ids not made by `lease_id`."""
    match = _LEASE_ID.fullmatch(lease)
    return int(match[1]) if match else None


class TaskQueue:
    def __init__(self, catalog: Catalog, taskset: Taskset, batch_tasks: int, lease_s: float,
                 revisit: float = 0.0, revisit_times: int = 2):
        self.catalog = catalog
        self.taskset = taskset
        self.batch_tasks = batch_tasks
        self.lease_s = lease_s
        self.revisit_slots = round(revisit * batch_tasks)  # the last slots of each batch
        self.revisit_times = revisit_times
        self.waiting: deque[tuple[int, dict[str, Any], int, int]] = deque()  # (row, task, times, ready batch)
        self.revisited: dict[int, tuple[dict[str, Any], int]] = {}  # seq -> (task, times issued before)
        self.revisit_seqs: list[int] = []  # sorted: the seqs that are revisits (the rest read the taskset)
        for row, task, times, ready, seq in self.catalog.revisits():
            if seq is None:
                self.waiting.append((row, task, times, ready))
            else:
                self.revisited[seq] = (task, times)
                self.revisit_seqs.append(seq)
        self.revisit_seqs.sort()
        self.leases: dict[str, Lease] = {}
        self.free: list[int] = []  # heap of seqs issued before whose lease lapsed
        self.dropped: dict[int, Lease] = {}  # free seq -> the lease its silent holder lost (`restore`)
        self.attempts: dict[int, int] = {}
        self.done: set[int] = set()
        self.done_per_batch: Counter[int] = Counter()
        self.next_seq = 0
        for seq, lid, holder, expires, attempt, done, req, session in self.catalog.tasks():
            self.next_seq = max(self.next_seq, seq + 1)
            self.attempts[seq] = attempt
            if done:
                self._mark_done(seq)
            elif lid:
                self.leases[lid] = Lease(lid, seq, holder, expires, req, session)
            else:
                heapq.heappush(self.free, seq)
        # Holders of leases granted before a restart, until they say HELLO (`claim`) or `release_unclaimed`.
        self.unclaimed = {lease.holder for lease in self.leases.values()}

    def granted(self, holder: str, req: int | None, before: float) -> list[tuple[Lease, dict[str, Any]]]:
        """The leases still out to `holder` that its request `req` was granted before `before` (when it said HELLO
        on the connection this LEASE came on), with their tasks: a resend of that LEASE after a reconnect or a
        broker restart is answered with them instead of a second grant. Granted on the same connection, they
        answered another request that happens to use the same req: a client need not number requests apart."""
        if req is None:
            return []
        mine = [lz for lz in self.leases.values()
                if lz.holder == holder and lz.req == req and lz.expires - self.lease_s < before]
        return [(lease, self.task(lease.seq)[0]) for lease in sorted(mine, key=lambda lz: lz.seq)]

    def claim(self, holder: str, session: str | None, now: float) -> tuple[list[Lease], list[Lease]]:
        """`holder` said HELLO with `session`; returns the leases released and those restored for it.

        Leases out under its name to another session are released: after a broker restart, a new process may
        take the name of one that is gone, and it cannot know what that one was granted (while the broker runs, a
        name passes on only once its leases are back). Leases this session lost when it was dropped for silence
        are its again where nobody took them since (`restore`)."""
        self.unclaimed.discard(holder)
        released = self._release([lz for lz in self.leases.values() if lz.holder == holder and lz.session != session])
        return released, self.restore(holder, session, now)

    def release_unclaimed(self) -> list[Lease]:
        """Leases granted before a restart to holders that have not said HELLO since: they are gone (or late)."""
        holders, self.unclaimed = self.unclaimed, set()
        return self._release([lz for lz in self.leases.values() if lz.holder in holders], keep=True)

    def restore(self, holder: str, session: str | None, now: float) -> list[Lease]:
        """`holder` said HELLO again with `session` after it was dropped for silence: the leases it lost then that
        are unexpired and still free (no other holder took the task, no group answered it) are its again, as they
        were (id, req, expiry), so the tasks it kept rolling out are not issued twice. Returns them."""
        back = [lz for lz in self.dropped.values()
                if lz.holder == holder and lz.session == session and lz.expires > now]
        if not back:
            return []
        try:  # recorded first
            self.catalog.lease([(lz.seq, lz.lease_id, lz.holder, lz.expires, self.attempts[lz.seq], lz.req,
                                 lz.session) for lz in back])
        except DISK_ERRORS:  # not recorded (a full disk): the tasks stay free, for any LEASE
            return []
        seqs = {lz.seq for lz in back}
        self.free = [seq for seq in self.free if seq not in seqs]
        heapq.heapify(self.free)
        for lease in back:
            del self.dropped[lease.seq]
            self.leases[lease.lease_id] = lease
        return back

    @property
    def exhausted(self) -> bool:
        size = len(self.taskset)
        return bool(size) and self._fresh(self.next_seq) >= size and not self.free

    def _fresh(self, seq: int) -> int:
        """The taskset index of seq (of the first fresh seq from `seq` on): seqs before it that were fresh."""
        return seq - bisect.bisect_left(self.revisit_seqs, seq)

    def task(self, seq: int) -> tuple[dict[str, Any], int]:
        """The task issued as `seq`, and how many times it was issued before."""
        return self.revisited.get(seq) or (self.taskset.task(self._fresh(seq)), 0)

    def _take_revisit(self, seq: int) -> tuple[int, dict[str, Any], int, int] | None:
        """Make the new `seq` a waiting revisit when its slot takes one and one is ready: the entry taken from
        `waiting` (its row first), else None."""
        batch = self.batch_of(seq)
        if seq % self.batch_tasks < self.batch_tasks - self.revisit_slots or not self.waiting \
                or self.waiting[0][3] > batch:
            return None
        entry = self.waiting.popleft()
        self.revisited[seq] = entry[1:3]
        self.revisit_seqs.append(seq)  # the newest seq: the list stays sorted
        return entry

    def batch_of(self, seq: int) -> int:
        return seq // self.batch_tasks

    def next_batch(self) -> int | None:
        """Batch index of the task the next LEASE would get, or None when none is left."""
        if self.free:
            return self.batch_of(self.free[0])
        if self.exhausted:
            return None
        return self.batch_of(self.next_seq)

    def past_end(self, batch_index: int) -> bool:
        """The batch lies wholly past the end of the taskset, which is exhausted: no task of it will ever be."""
        return self.exhausted and batch_index * self.batch_tasks >= self.next_seq

    def batch_resolved(self, batch_index: int) -> bool:
        """Every task of the batch has a stored group (or lies past the end of the taskset)."""
        first = batch_index * self.batch_tasks
        last = min(first + self.batch_tasks, self.next_seq) if self.exhausted else first + self.batch_tasks
        return self.done_per_batch[batch_index] >= max(0, last - first)

    def lease(self, holder: str, max_tasks: int, now: float, admit: Callable[[int], bool], req: int | None = None,
              session: str | None = None) -> list[tuple[Lease, dict[str, Any]]]:
        """Lease up to `max_tasks` tasks, in seq order, while `admit(batch_index)` allows; `req` and `session`: the
        request granted and its holder's session (`granted`, `claim`)."""
        out: list[tuple[Lease, dict[str, Any]]] = []
        rows, revisits, taken = [], [], []
        fresh_from, free_before = self.next_seq, list(self.free)
        while len(out) < max_tasks:
            batch = self.next_batch()
            if batch is None or not admit(batch):
                break
            if self.free:
                seq = heapq.heappop(self.free)
            else:
                seq = self.next_seq
                self.next_seq += 1
                entry = self._take_revisit(seq)
                if entry is not None:
                    revisits.append((entry[0], seq))
                    taken.append((entry, seq))
            attempt = self.attempts.get(seq, -1) + 1
            self.attempts[seq] = attempt
            lease = Lease(lease_id(seq, attempt), seq, holder, now + self.lease_s, req, session)
            self.leases[lease.lease_id] = lease
            rows.append((seq, lease.lease_id, holder, lease.expires, attempt, req, session))
            out.append((lease, self.task(seq)[0]))
        if rows:
            try:
                self.catalog.lease(rows, revisits)
                for row in rows:  # taken by a LEASE: no longer the dropped holder's to get back
                    self.dropped.pop(row[0], None)
            except Exception:  # not recorded (a full disk): nothing is leased, the queue is as it was
                for seq, lid, _, _, attempt, _, _ in rows:
                    del self.leases[lid]
                    if attempt:
                        self.attempts[seq] = attempt - 1
                    else:
                        del self.attempts[seq]
                self.next_seq, self.free = fresh_from, free_before
                for entry, seq in reversed(taken):
                    del self.revisited[seq]
                    self.revisit_seqs.remove(seq)
                    self.waiting.appendleft(entry)
                raise
        return out

    def complete(self, group_id: str, informative: bool = False) -> None:
        """A group answering lease `group_id` is stored: its task is done (and queued again, if `informative`
        and revisits are on)."""
        seq = seq_of(group_id)
        if seq is None or seq in self.done or seq >= self.next_seq:
            return
        revisit = None
        if informative and self.revisit_slots:
            task, times = self.task(seq)
            if times < self.revisit_times:
                revisit = (task, times + 1, self.batch_of(seq) + 2)
        try:
            row = self.catalog.task_done(seq, revisit)
        except DISK_ERRORS as exc:  # its group is stored all the same: the task is done
            _behind("task_done", [seq], exc)
            row, revisit = None, None  # a revisit the catalogue does not know of would change what its seq is
        for lid in [lid for lid, lease in self.leases.items() if lease.seq == seq]:
            del self.leases[lid]
        if seq in self.free:
            self.free.remove(seq)
            heapq.heapify(self.free)
        self.dropped.pop(seq, None)
        if revisit is not None:
            self.waiting.append((row, *revisit))
        self._mark_done(seq)

    def _mark_done(self, seq: int) -> None:
        self.done.add(seq)
        self.done_per_batch[self.batch_of(seq)] += 1

    def _release(self, leases: list[Lease], keep: bool = False) -> list[Lease]:
        """Return the leases' tasks to the queue; `keep`: their holder may come back for them (`restore`)."""
        if leases:
            try:
                self.catalog.release([lease.seq for lease in leases])
            except DISK_ERRORS as exc:  # released all the same: the holder is gone or late
                _behind("release", [lease.seq for lease in leases], exc)
        for lease in leases:
            del self.leases[lease.lease_id]
            heapq.heappush(self.free, lease.seq)
            if keep:
                self.dropped[lease.seq] = lease
        return leases

    def release_holder(self, holder: str, keep: bool = False) -> list[Lease]:
        return self._release([lease for lease in self.leases.values() if lease.holder == holder], keep)

    def expire(self, now: float) -> list[Lease]:
        return self._release([lease for lease in self.leases.values() if lease.expires <= now])

    def held_by(self, holder: str) -> int:
        return sum(1 for lease in self.leases.values() if lease.holder == holder)


def _behind(change: str, seqs: list[int], exc: Exception) -> None:
    """A change the catalogue could not record (a full or failing disk) that the queue makes all the same: a task
    done or a lease given back cannot be refused to whoever caused it. A lease given back is recorded with the
    seq's next lease; a broker restarted before then finds it still out and releases it when its holder does not
    come back. A task done stays unrecorded: a broker restarted after it issues the task again."""
    log.warning("catalog_behind", change=change, seqs=seqs[:16], error=str(exc))

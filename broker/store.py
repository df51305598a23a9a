"""The broker's durable replay buffer: an in-memory index over a segment log and a catalogue.

Payloads go to append-only segment files (`segments.py`); their metadata, the
groups, the delivered batches and the broker's own state live in SQLite
(`catalog.py`, WAL mode). This is the Titanic idea and the way Kafka stores
logs: SQLite alone tops out well below raw ZeroMQ for 9 KB rows on this disk,
sequential appends with one fdatasync per group commit do not
(docs/architecture.md has the figures).

Write order makes crashes safe: payload bytes are appended (and, with
`fsync: group`, synced) before the metadata that points at them is
committed, and the broker ACKs only after that commit. Bytes appended but
never committed are unreachable garbage; each start opens a new segment.

The in-memory indexes (ids, groups, ready queue) are rebuilt from the catalogue at start, so
queries never touch the disk except to read payloads back.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbus.broker.catalog import FILE as CATALOG_FILE, Catalog
from rlbus.broker.segments import SegmentLog, crc32

# Group states. FILLING and READY follow from the samples stored; the others are in the batches and retired tables.
FILLING, READY, DELIVERED, COMMITTED, EXPIRED, SKIPPED = range(6)
_RETIRED = {COMMITTED: "committed", EXPIRED: "expired", SKIPPED: "skipped"}


@dataclass(slots=True)
class Traj:
    id: str
    policy_version: int
    reward: float
    segment: int
    offset: int
    length: int
    crc: int
    meta: dict[str, Any]
    data: memoryview | None = None  # payload kept in memory until retired, within the cache budget
    src_off: int = 0  # where `data` starts in data.obj (the PUT frame it is a view of, or its own bytes)


@dataclass(slots=True)
class WriteJob:
    """Trajectories of one group commit: one chunk (a `chunks` row) per PUT message."""

    chunks: list[list[Traj]] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    number: int = 0
    acks: list[Any] = field(default_factory=list)  # the loop's bookkeeping: who to ACK when durable
    stored_by: list[set[str]] = field(default_factory=list)  # per PUT message planned: the ids it stores
    received: float = 0.0  # when its PUTs were taken off the socket (monotonic), for the PUT-to-ACK latency


@dataclass(slots=True)
class Group:
    group_id: str
    batch_index: int
    size: int
    state: int = FILLING
    step: int | None = None
    trajs: list[Traj] = field(default_factory=list)
    min_version: int = 0  # of its trajectories (kept by `Store._attach`): FETCH checks staleness by it

    @property
    def zero_spread(self) -> bool:
        rewards = [t.reward for t in self.trajs]
        return max(rewards) == min(rewards)


class Store:
    """Durable trajectories, groups and batches; see the module docstring."""

    def __init__(self, directory: str | Path, fsync: str = "group", segment_bytes: int = 256 << 20,
                 cache_bytes: int = 512 << 20):
        self.dir = Path(directory)
        self.fsync = fsync == "group"
        self.cache_budget = cache_bytes
        self.cached = 0
        self.segments = SegmentLog(self.dir / "segments", self.fsync, segment_bytes)
        self.catalog = Catalog(self.dir / CATALOG_FILE, self.fsync)
        self.pending_ids: set[str] = set()
        self.pending_groups: Counter[str] = Counter()  # group id -> trajectories of it being written
        self.ids: set[str] = set()
        self.groups: dict[str, Group] = {}
        self.ready: dict[str, Group] = {}
        self.batches: dict[int, list[str]] = {}  # uncommitted delivered batches: step -> group ids
        self.retired_with: dict[int, tuple[int, int]] = {}  # their (expired, skipped) trajectories, sent again
        self.committed_step = -1
        self.counts = {"stored": 0, "committed": 0, "expired": 0, "skipped": 0}
        self._recover()

    def _recover(self) -> None:
        trajs = []
        for meta, segment, offset, length, crc in self.catalog.placed():
            trajs.append(Traj(meta["id"], meta["policy_version"], float(meta["reward"]), segment, offset, length,
                              crc, meta))
        self._attach(trajs)
        for step, group_ids, committed in self.catalog.batches():
            for gid in group_ids:
                self._set_state(self.groups[gid], COMMITTED if committed else DELIVERED, step)
            if not committed:
                self.batches[step] = group_ids
        for step, record, committed in self.catalog.deliveries():
            if not committed:
                self.retired_with[step] = (record["expired"], record["skipped"])
        for state, group_ids in self.catalog.retired():
            for gid in group_ids:
                self._set_state(self.groups[gid], state)
        self.committed_step = int(self.catalog.get_meta("committed_step", -1))

    # ---- state kept beside the buffer -------------------------------------

    def get_meta(self, key: str, default: Any = None) -> Any:
        return self.catalog.get_meta(key, default)

    def set_meta(self, key: str, value: Any) -> None:
        self.catalog.set_meta(key, value)

    # ---- writes -----------------------------------------------------------

    @property
    def depth(self) -> int:
        """Trajectories stored or being stored, and not yet retired (committed, expired or skipped)."""
        c = self.counts
        return c["stored"] + len(self.pending_ids) - c["committed"] - c["expired"] - c["skipped"]

    def refuse_join(self, metas: list[dict[str, Any]], adding: Counter, sizes: dict[str, int],
                    seen: set[str]) -> str | None:
        """Why these new trajectories cannot join their groups, or None (then they are counted in `adding`).

        A group takes exactly `group_size` samples: a trajectory for a group
        that is full, already delivered or retired, or that disagrees about
        the group's size would be stored and never trained on, so the PUT is
        refused before anything is stored. `adding`, `sizes` and `seen` carry
        what earlier PUTs of the same drain will add.
        """
        mine: dict[str, int] = {}
        new: set[str] = set()
        # Per group, looked up once per PUT: (its size, the samples it has or gets before this PUT, its state).
        known: dict[str, tuple[int, int, int]] = {}
        ids, pending = self.ids, self.pending_ids
        for m in metas:
            tid = m["id"]
            if tid in ids or tid in pending or tid in seen or tid in new:
                continue  # a resend: answered as a duplicate
            new.add(tid)
            gid, size = m["group_id"], m["group_size"]
            facts = known.get(gid)
            if facts is None:
                group = self.groups.get(gid)
                before = self.pending_groups.get(gid, 0) + adding.get(gid, 0)
                facts = known[gid] = ((sizes.get(gid, size), before, FILLING) if group is None else
                                      (group.size, len(group.trajs) + before, group.state))
            group_size, have, state = facts
            if group_size != size:
                return f"trajectory {tid}: group {gid} has group_size {group_size}, this trajectory says {size}"
            if state != FILLING:
                return f"trajectory {tid}: group {gid} is complete already; no sample can join it"
            count = mine.get(gid, 0)
            if have + count >= size:
                return f"trajectory {tid}: group {gid} has all its {size} samples already"
            mine[gid] = count + 1
        adding.update(mine)
        seen |= new
        for m in metas:
            sizes.setdefault(m["group_id"], m["group_size"])
        return None

    def prepare(self, batches: list[list[tuple[dict[str, Any], memoryview]]]) -> WriteJob | None:
        """Plan the group commit of several PUT messages: ids not stored yet, and where their bytes go.

        Runs on the broker's loop; `write` (on the writer thread) makes the job
        durable and `finish` (back on the loop) makes it visible. Ids in a job
        count as pending until then, so a resend cannot be stored twice. A PUT's payloads are views
        of its frame back to back (`split_payloads`) or bytes of their own.
        """
        job = WriteJob()
        self.segments.align()
        ids, pending, planned = self.ids, self.pending_ids, job.ids
        for items in batches:
            self.segments.start_chunk(items[0][1] if items else b"", sum(len(p) for _, p in items))
            segment, start = self.segments.place(0)  # a chunk's payloads go back to back from here
            offset = start
            chunk = []
            stored = set()
            src_off = 0  # offset of each payload in the frame it arrived in
            for meta, payload in items:
                size = len(payload)
                tid = meta["id"]
                if tid not in ids and tid not in pending and tid not in planned:
                    view, at = (payload, src_off) if isinstance(payload, memoryview) else (memoryview(payload), 0)
                    chunk.append(Traj(tid, meta["policy_version"], float(meta["reward"]), segment, offset, size, 0,
                                      meta, view, at))
                    offset += size
                    planned.add(tid)
                    stored.add(tid)
                src_off += size
            self.segments.place(offset - start)
            job.stored_by.append(stored)
            if chunk:
                job.chunks.append(chunk)
        if not job.chunks:
            return None
        self.pending_ids |= job.ids
        self.pending_groups.update(t.meta["group_id"] for chunk in job.chunks for t in chunk)
        return job

    def write(self, jobs: list[WriteJob]) -> None:
        """Append the jobs' payloads, sync them, then commit their metadata (writer thread)."""
        chunks = [chunk for job in jobs for chunk in job.chunks]
        runs: dict[int, list[tuple[int, list[memoryview]]]] = {}  # segment -> (offset, payloads back to back)
        for chunk in sorted(chunks, key=lambda c: (c[0].segment, c[0].offset)):
            segment_runs = runs.setdefault(chunk[0].segment, [])
            last = segment_runs[-1] if segment_runs else None
            pieces = self.payload_frames(chunk)  # neighbours in one PUT frame: one piece, copied once
            if last is not None and last[0] + sum(len(b) for b in last[1]) == chunk[0].offset:
                last[1].extend(pieces)
            else:
                segment_runs.append((chunk[0].offset, pieces))
        self.segments.write(runs)
        for chunk in chunks:
            for traj in chunk:
                traj.crc = crc32(traj.data)
        self.catalog.add_chunks((c[0].segment, c[0].offset, [(t.meta, t.length, t.crc) for t in c]) for c in chunks)

    def finish(self, job: WriteJob) -> list[Group]:
        """The job is durable: index its trajectories; returns the groups it completed."""
        self._unpend(job)
        trajs = [t for chunk in job.chunks for t in chunk]
        for traj in trajs:
            if self.cached < self.cache_budget:
                self.cached += traj.length
            else:
                traj.data = None
        return self._attach(trajs)

    def abandon(self, job: WriteJob) -> None:
        """The job could not be written: forget it (nothing was ACKed)."""
        self._unpend(job)

    def _unpend(self, job: WriteJob) -> None:
        self.pending_ids -= job.ids
        self.pending_groups.subtract(t.meta["group_id"] for chunk in job.chunks for t in chunk)
        self.pending_groups = +self.pending_groups

    def put(self, batches: list[list[tuple[dict[str, Any], bytes]]]) -> tuple[set[str], list[Group]]:
        """prepare, write and finish in one go; returns (ids newly stored, groups completed)."""
        job = self.prepare(batches)
        if job is None:
            return set(), []
        try:
            self.write([job])
        except BaseException:
            self.abandon(job)
            raise
        return job.ids, self.finish(job)

    def _attach(self, trajs: list[Traj]) -> list[Group]:
        touched: dict[str, Group] = {}
        gid, group = None, None
        for traj in trajs:
            meta = traj.meta
            if meta["group_id"] != gid:  # a group's samples mostly arrive together
                gid = meta["group_id"]
                group = self.groups.get(gid)
                if group is None:
                    group = self.groups[gid] = Group(gid, meta["batch_index"], meta["group_size"],
                                                     min_version=traj.policy_version)
                touched[gid] = group
            group.trajs.append(traj)
            if traj.policy_version < group.min_version:
                group.min_version = traj.policy_version
        self.ids.update(t.id for t in trajs)
        self.counts["stored"] += len(trajs)
        completed = []
        for group in touched.values():
            if group.state == FILLING and len(group.trajs) >= group.size:
                group.state = READY
                self.ready[group.group_id] = group
                completed.append(group)
        return completed

    def _set_state(self, group: Group, state: int, step: int | None = None) -> None:
        self.ready.pop(group.group_id, None)
        group.state = state
        if step is not None:
            group.step = step
        if state in _RETIRED:
            self.counts[_RETIRED[state]] += len(group.trajs)
            for traj in group.trajs:
                if traj.data is not None:
                    self.cached -= traj.length
                    traj.data = None

    # ---- reads for the trainer --------------------------------------------

    def select(self, step: int, max_groups: int, max_staleness: int, batch_index: int | None,
               skip_zero_spread: bool) -> tuple[list[Group], int, int]:
        """Pick ready groups for `step`, retiring stale and zero-spread ones.

        Returns (groups, trajectories expired, trajectories skipped). Groups are
        not marked delivered here: `deliver` does that once the caller takes them.
        """
        chosen, expired, skipped = [], [], []
        # Oldest batch first; within a batch, in the order groups completed (sort is stable).
        candidates = sorted(self.ready.values(), key=lambda g: g.batch_index)
        for group in candidates:
            if batch_index is not None and group.batch_index != batch_index:
                continue
            if step - group.min_version > max_staleness:
                expired.append(group)
            elif skip_zero_spread and group.zero_spread:
                skipped.append(group)
            elif len(chosen) < max_groups:
                chosen.append(group)
        self._retire(expired, EXPIRED)
        self._retire(skipped, SKIPPED)
        return chosen, sum(len(g.trajs) for g in expired), sum(len(g.trajs) for g in skipped)

    def _retire(self, groups: list[Group], state: int) -> None:
        if not groups:
            return
        self.catalog.retire(state, [g.group_id for g in groups])
        for group in groups:
            self._set_state(group, state)

    def deliver(self, step: int, groups: list[Group], meta: dict[str, Any] | None = None, expired: int = 0,
                skipped: int = 0) -> None:
        """Record `groups` as the batch of `step` (and `meta` beside it), so a restart re-delivers it, and
        what it holds in the order sent (with the trajectories retired while it was made), so a replay can
        train on exactly that."""
        ids = [g.group_id for g in groups]
        record = {"trajectories": [[t.id for t in g.trajs] for g in groups], "expired": expired, "skipped": skipped}
        self.catalog.deliver(step, ids, record, meta or {})
        for group in groups:
            self._set_state(group, DELIVERED, step)
        self.batches[step] = ids
        self.retired_with[step] = (expired, skipped)

    def was_delivered(self, step: int) -> bool:
        """Whether a batch was ever delivered for `step` (committed since or not)."""
        return self.catalog.was_delivered(step)

    def delivered(self, step: int) -> list[Group] | None:
        """The uncommitted batch already delivered for `step`, if any."""
        ids = self.batches.get(step)
        return None if ids is None else [self.groups[g] for g in ids]

    def commit(self, step: int) -> int:
        """Retire every delivered batch up to `step`; returns trajectories committed."""
        steps = [s for s in self.batches if s <= step]
        self.catalog.commit(steps, max(self.committed_step, step))
        self.committed_step = max(self.committed_step, step)
        n = 0
        for s in steps:
            self.retired_with.pop(s, None)
            for gid in self.batches.pop(s):
                group = self.groups[gid]
                self._set_state(group, COMMITTED)
                n += len(group.trajs)
        return n

    def payload_frames(self, trajs: list[Traj]) -> list[memoryview | bytes]:
        """The trajectories' payloads back to back, as few frames as they allow.

        Payloads still in memory are views of the PUT frames they arrived in;
        neighbours from the same frame become one view, sent without a copy.
        """
        frames: list[memoryview | bytes] = []
        run: tuple[Any, int, int] | None = None  # (source object, start, end)
        for traj in trajs:
            data = traj.data
            if data is not None and run is not None and data.obj is run[0] and traj.src_off == run[2]:
                run = (run[0], run[1], run[2] + traj.length)
                continue
            if run is not None:
                frames.append(memoryview(run[0])[run[1]:run[2]])
                run = None
            if data is not None:
                run = (data.obj, traj.src_off, traj.src_off + traj.length)
            else:
                frames.append(self.payload(traj))
        if run is not None:
            frames.append(memoryview(run[0])[run[1]:run[2]])
        return frames

    def payload(self, traj: Traj) -> bytes | memoryview:
        if traj.data is not None:
            return traj.data
        return self.segments.read(traj.segment, traj.offset, traj.length, traj.crc, f"trajectory {traj.id}")

    def close(self) -> None:
        self.segments.close()
        self.catalog.close()

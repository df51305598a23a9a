"""The broker's durable replay buffer.

Payloads go to append-only segment files; their metadata, the groups, the
delivered batches and the broker's own state live in SQLite (WAL mode). This
is the Titanic idea and the way Kafka stores logs: SQLite alone tops out well
below raw ZeroMQ for 9 KB rows on this disk, sequential appends with one
fdatasync per group commit do not (docs/architecture.md has the figures).

Write order makes crashes safe: payload bytes are appended (and, with
`fsync: group`, synced) before the metadata that points at them is
committed, and the broker ACKs only after that commit. Bytes appended but
never committed are unreachable garbage; each start opens a new segment.

The in-memory indexes (ids, groups, ready queue) are rebuilt from SQLite at
start, so queries never touch the disk except to read payloads back.
"""

from __future__ import annotations

import os
import sqlite3
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

from common.protocol import pack, unpack

# Group states.
FILLING, READY, DELIVERED, COMMITTED, EXPIRED, SKIPPED = range(6)
_RETIRED = (COMMITTED, EXPIRED, SKIPPED)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB);
CREATE TABLE IF NOT EXISTS trajectories (
    rowid INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, group_id TEXT NOT NULL,
    policy_version INTEGER NOT NULL, reward REAL NOT NULL,
    segment INTEGER NOT NULL, offset INTEGER NOT NULL, length INTEGER NOT NULL, crc INTEGER NOT NULL,
    meta BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    group_id TEXT PRIMARY KEY, batch_index INTEGER NOT NULL, group_size INTEGER NOT NULL,
    state INTEGER NOT NULL, step INTEGER);
CREATE TABLE IF NOT EXISTS batches (step INTEGER PRIMARY KEY, committed INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS tasks (
    seq INTEGER PRIMARY KEY, lease_id TEXT, holder TEXT, expires REAL, attempt INTEGER NOT NULL,
    done INTEGER NOT NULL DEFAULT 0);
"""


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


@dataclass(slots=True)
class Group:
    group_id: str
    batch_index: int
    size: int
    state: int = FILLING
    step: int | None = None
    trajs: list[Traj] = field(default_factory=list)

    @property
    def min_version(self) -> int:
        return min(t.policy_version for t in self.trajs)

    @property
    def zero_spread(self) -> bool:
        rewards = [t.reward for t in self.trajs]
        return max(rewards) == min(rewards)


class Store:
    """Durable trajectories, groups and batches; see the module docstring."""

    def __init__(self, directory: str | Path, fsync: str = "group", segment_bytes: int = 256 << 20):
        self.dir = Path(directory)
        (self.dir / "segments").mkdir(parents=True, exist_ok=True)
        self.fsync = fsync == "group"
        self.segment_bytes = segment_bytes
        self.db = sqlite3.connect(self.dir / "buffer.sqlite3", isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={'FULL' if self.fsync else 'NORMAL'}")
        self.db.executescript(_SCHEMA)
        self.ids: set[str] = set()
        self.groups: dict[str, Group] = {}
        self.ready: dict[str, Group] = {}
        self.batches: dict[int, list[str]] = {}  # uncommitted delivered batches: step -> group ids
        self.committed_step = -1
        self.counts = {"stored": 0, "committed": 0, "expired": 0, "skipped": 0}
        self._readers: dict[int, int] = {}
        self._recover()
        existing = [int(p.stem) for p in (self.dir / "segments").glob("*.seg")]
        self._open_segment(max(existing, default=-1) + 1)

    # ---- start-up ---------------------------------------------------------

    def _recover(self) -> None:
        for gid, batch_index, size, state, step in self.db.execute(
                "SELECT group_id, batch_index, group_size, state, step FROM groups"):
            self.groups[gid] = Group(gid, batch_index, size, state, step)
        for row in self.db.execute("SELECT rowid, id, group_id, policy_version, reward, segment, offset, length, crc, meta "
                                   "FROM trajectories ORDER BY rowid"):
            traj = Traj(row[1], row[3], row[4], row[5], row[6], row[7], row[8], unpack(row[9]))
            self.ids.add(traj.id)
            self.groups[row[2]].trajs.append(traj)
        for group in self.groups.values():
            if group.state == READY:
                self.ready[group.group_id] = group
            elif group.state == DELIVERED:
                self.batches.setdefault(group.step, []).append(group.group_id)
            if group.state in _RETIRED:
                self.counts[{COMMITTED: "committed", EXPIRED: "expired", SKIPPED: "skipped"}[group.state]] += len(group.trajs)
        self.counts["stored"] = len(self.ids)
        row = self.db.execute("SELECT value FROM meta WHERE key='committed_step'").fetchone()
        self.committed_step = int(row[0]) if row else -1

    def _open_segment(self, index: int) -> None:
        self.segment = index
        path = self.dir / "segments" / f"{index:08d}.seg"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._offset = os.fstat(self._fd).st_size

    @contextmanager
    def transaction(self) -> Iterator[None]:
        self.db.execute("BEGIN")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # ---- state kept beside the buffer -------------------------------------

    def get_meta(self, key: str, default: Any = None) -> Any:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return unpack(row[0]) if row else default

    def set_meta(self, key: str, value: Any) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, pack(value)))

    # ---- writes -----------------------------------------------------------

    @property
    def depth(self) -> int:
        """Trajectories stored and not yet retired (committed, expired or skipped)."""
        c = self.counts
        return c["stored"] - c["committed"] - c["expired"] - c["skipped"]

    def put(self, items: Iterable[tuple[dict[str, Any], bytes]]) -> tuple[list[str], list[str], list[Group]]:
        """Store trajectories durably, once per id.

        Returns (stored ids, duplicate ids, groups that became complete). On
        return everything stored is durable: the caller may ACK it.
        """
        stored, duplicate, fresh = [], [], []
        seen: set[str] = set()
        for meta, payload in items:
            if meta["id"] in self.ids or meta["id"] in seen:
                duplicate.append(meta["id"])
            else:
                seen.add(meta["id"])
                fresh.append((meta, payload))
        if not fresh:
            return stored, duplicate, []
        if self._offset >= self.segment_bytes:
            os.close(self._fd)
            self._open_segment(self.segment + 1)
        blob = b"".join(p for _, p in fresh)
        os.write(self._fd, blob)
        if self.fsync:
            os.fdatasync(self._fd)
        rows, trajs, new_groups = [], [], {}
        offset = self._offset
        for meta, payload in fresh:
            crc = zlib.crc32(payload)
            rows.append((meta["id"], meta["group_id"], meta["policy_version"], float(meta["reward"]),
                         self.segment, offset, len(payload), crc, pack(meta)))
            trajs.append(Traj(meta["id"], meta["policy_version"], float(meta["reward"]),
                              self.segment, offset, len(payload), crc, meta))
            offset += len(payload)
            gid = meta["group_id"]
            if gid not in self.groups and gid not in new_groups:
                new_groups[gid] = Group(gid, meta["batch_index"], meta["group_size"])
        with self.transaction():
            self.db.executemany(
                "INSERT INTO trajectories(id, group_id, policy_version, reward, segment, offset, length, crc, meta) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
            self.db.executemany("INSERT INTO groups(group_id, batch_index, group_size, state) VALUES (?, ?, ?, ?)",
                                [(g.group_id, g.batch_index, g.size, FILLING) for g in new_groups.values()])
            completed = self._attach(trajs, new_groups)
            if completed:
                self.db.executemany("UPDATE groups SET state=? WHERE group_id=?",
                                    [(READY, g.group_id) for g in completed])
        self._offset = offset
        for meta, _ in fresh:
            self.ids.add(meta["id"])
            stored.append(meta["id"])
        self.counts["stored"] += len(stored)
        return stored, duplicate, completed

    def _attach(self, trajs: list[Traj], new_groups: dict[str, Group]) -> list[Group]:
        self.groups.update(new_groups)
        touched: dict[str, Group] = {}
        for traj in trajs:
            group = self.groups[traj.meta["group_id"]]
            group.trajs.append(traj)
            touched[group.group_id] = group
        completed = []
        for group in touched.values():
            if group.state == FILLING and len(group.trajs) >= group.size:
                group.state = READY
                self.ready[group.group_id] = group
                completed.append(group)
        return completed

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
        self.db.executemany("UPDATE groups SET state=? WHERE group_id=?", [(state, g.group_id) for g in groups])
        for group in groups:
            group.state = state
            self.ready.pop(group.group_id, None)
            self.counts["expired" if state == EXPIRED else "skipped"] += len(group.trajs)

    def deliver(self, step: int, groups: list[Group]) -> None:
        """Record `groups` as the batch of `step`, durably, so a restart re-delivers it."""
        with self.transaction():
            self.db.execute("INSERT OR REPLACE INTO batches(step, committed) VALUES (?, 0)", (step,))
            self.db.executemany("UPDATE groups SET state=?, step=? WHERE group_id=?",
                                [(DELIVERED, step, g.group_id) for g in groups])
        for group in groups:
            group.state, group.step = DELIVERED, step
            self.ready.pop(group.group_id, None)
        self.batches[step] = [g.group_id for g in groups]

    def delivered(self, step: int) -> list[Group] | None:
        """The uncommitted batch already delivered for `step`, if any."""
        ids = self.batches.get(step)
        return None if ids is None else [self.groups[g] for g in ids]

    def commit(self, step: int) -> int:
        """Retire every delivered batch up to `step`; returns trajectories committed."""
        steps = [s for s in self.batches if s <= step]
        groups = [self.groups[g] for s in steps for g in self.batches[s]]
        with self.transaction():
            self.db.executemany("UPDATE batches SET committed=1 WHERE step=?", [(s,) for s in steps])
            self.db.executemany("UPDATE groups SET state=? WHERE group_id=?",
                                [(COMMITTED, g.group_id) for g in groups])
            self.committed_step = max(self.committed_step, step)
            self.set_meta("committed_step", self.committed_step)
        n = 0
        for s in steps:
            del self.batches[s]
        for group in groups:
            group.state = COMMITTED
            n += len(group.trajs)
        self.counts["committed"] += n
        return n

    def payload(self, traj: Traj) -> bytes:
        fd = self._readers.get(traj.segment)
        if fd is None:
            fd = os.open(self.dir / "segments" / f"{traj.segment:08d}.seg", os.O_RDONLY)
            self._readers[traj.segment] = fd
        data = os.pread(fd, traj.length, traj.offset)
        if len(data) != traj.length or zlib.crc32(data) != traj.crc:
            raise IOError(f"payload of trajectory {traj.id} in segment {traj.segment} is damaged (crc mismatch)")
        return data

    def close(self) -> None:
        os.close(self._fd)
        for fd in self._readers.values():
            os.close(fd)
        self._readers.clear()
        self.db.close()

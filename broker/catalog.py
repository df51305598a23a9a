"""The broker's SQLite catalogue: the only module that speaks SQL.

It records where each group commit's trajectories lie in the segment log
(`chunks`), the delivered batches (and, for `rlbus replay`, exactly what
each delivered: `deliveries`), the retired groups, the task leases and the
broker's own state (`meta`). WAL mode: only the writer thread's
connection syncs on commit (when fsync is on), and trajectories are ACKed
after that commit. The loop's own small writes (leases, batches, commits)
survive a process crash at once and a power loss with the next group commit,
which syncs the same WAL; losing one to a power cut means a batch is
delivered again, never lost.
"""

from __future__ import annotations

import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

from rlbus.common.protocol import brief, pack, unpack

DISK_ERRORS = (sqlite3.Error, OSError)  # what writing the catalogue raises on a full or failing disk


def unrecorded(exc: Exception) -> str:
    """The `storage_error` message for a request the catalogue could not record: nothing changed."""
    return f"nothing was recorded, resend later: {brief(exc)}"


def storage_error(message: str, retry_after_s: float) -> dict[str, Any]:
    """The ERROR header refusing a request the disk could not take: resend it, a HELLO after `retry_after_s`."""
    return {"code": "storage_error", "message": message, "retry_after_s": retry_after_s}


BUSY_TIMEOUT_S = 30.0  # how long a write waits for another to end before it fails

# One `chunks` row per group commit of one PUT message: the metadata of its
# trajectories, packed together, whose payloads lie back to back in the
# segment from `offset`. Writing per message rather than per trajectory is
# what lets SQLite keep up with ZeroMQ.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB);
CREATE TABLE IF NOT EXISTS chunks (
    rowid INTEGER PRIMARY KEY, segment INTEGER NOT NULL, offset INTEGER NOT NULL, entries BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (step INTEGER PRIMARY KEY, groups BLOB NOT NULL, committed INTEGER NOT NULL);
-- What the BATCH of each step held, in the order sent: the trajectory ids of each group, and the
-- expired and skipped counts. Kept after commit: it is the run's record for `rlbus replay`.
CREATE TABLE IF NOT EXISTS deliveries (step INTEGER PRIMARY KEY, record BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS retired (rowid INTEGER PRIMARY KEY, state INTEGER NOT NULL, groups BLOB NOT NULL);
-- A lease's req and session: the LEASE request that granted it and its holder's HELLO session (see tasks.py).
CREATE TABLE IF NOT EXISTS tasks (
    seq INTEGER PRIMARY KEY, lease_id TEXT, holder TEXT, expires REAL, attempt INTEGER NOT NULL,
    done INTEGER NOT NULL DEFAULT 0, req INTEGER, session TEXT);
-- Tasks to issue again (data.revisit), in queue order: the task, how often it was issued before, the first
-- batch that may take it, and the seq it was issued as (NULL while it waits).
CREATE TABLE IF NOT EXISTS revisits (
    rowid INTEGER PRIMARY KEY, task BLOB NOT NULL, times INTEGER NOT NULL, ready INTEGER NOT NULL, seq INTEGER);
"""


FILE = "buffer.sqlite3"  # in the buffer directory


class Catalog:
    def __init__(self, path: str | Path, fsync: bool, readonly: bool = False):
        """`readonly`: a reader beside the broker (or after it): changes nothing, not even the schema."""
        self.path = Path(path)
        self.fsync = fsync
        if readonly:
            if not self.path.exists():
                raise FileNotFoundError(f"no broker catalogue at {self.path}")
            self.db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, isolation_level=None,
                                      check_same_thread=False, timeout=30)
        else:
            self.db = self._connect()
            self.db.executescript(_SCHEMA)
            for column in ("req INTEGER", "session TEXT"):  # a catalogue written before leases kept them
                if column.split()[0] not in self._columns("tasks"):
                    self.db.execute(f"ALTER TABLE tasks ADD COLUMN {column}")
        self._wdb: sqlite3.Connection | None = None
        # One writer at a time, as SQLite allows, queued here: a connection that finds the other's write
        # under way would get SQLITE_BUSY and sleep in SQLite's busy handler (1, 2, 5, 10... ms steps), and
        # the loop would stand still for longer than the writer thread's commit takes.
        self._writing = threading.RLock()

    def _connect(self, full_sync: bool = False) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={'FULL' if full_sync else 'NORMAL'}")
        return db

    @contextmanager
    def _turn(self) -> Iterator[None]:
        """This thread's turn to write; as SQLite's own busy timeout, an error after BUSY_TIMEOUT_S (a disk that
        stopped under the other writer fails the request that waited, and the loop goes on)."""
        if not self._writing.acquire(timeout=BUSY_TIMEOUT_S):
            raise sqlite3.OperationalError(f"the catalogue's other writer has held it for {BUSY_TIMEOUT_S} s")
        try:
            yield
        finally:
            self._writing.release()

    @contextmanager
    def transaction(self, db: sqlite3.Connection | None = None) -> Iterator[None]:
        db = db or self.db
        with self._turn():
            db.execute("BEGIN")
            try:
                yield
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    # ---- the broker's own state -------------------------------------------

    def get_meta(self, key: str, default: Any = None) -> Any:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return unpack(row[0]) if row else default

    def set_meta(self, key: str, value: Any) -> None:
        with self._turn():
            self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, pack(value)))

    # ---- trajectories -----------------------------------------------------

    def chunks(self) -> Iterator[tuple[int, int, list]]:
        """(segment, offset, [(meta, length, crc), ...]) for every stored chunk, in write order."""
        for segment, offset, entries in self.db.execute("SELECT segment, offset, entries FROM chunks ORDER BY rowid"):
            yield segment, offset, unpack(entries)

    def placed(self) -> Iterator[tuple[dict, int, int, int, int]]:
        """(meta, segment, offset, length, crc) of every stored trajectory, in write order."""
        for segment, offset, entries in self.chunks():
            for meta, length, crc in entries:
                yield meta, segment, offset, length, crc
                offset += length

    def add_chunks(self, rows: Iterable[tuple[int, int, list]]) -> None:
        """Record chunks (writer thread, on its own connection: WAL lets it commit beside the loop)."""
        if self._wdb is None:
            self._wdb = self._connect(full_sync=self.fsync)
        with self.transaction(self._wdb):
            self._wdb.executemany("INSERT INTO chunks(segment, offset, entries) VALUES (?, ?, ?)",
                                  [(s, o, pack(entries)) for s, o, entries in rows])

    # ---- batches and retired groups ---------------------------------------

    def batches(self) -> Iterator[tuple[int, list[str], bool]]:
        """(step, group ids, committed) for every delivered batch, by step."""
        for step, groups, committed in self.db.execute("SELECT step, groups, committed FROM batches ORDER BY step"):
            yield step, unpack(groups), bool(committed)

    def retired(self) -> Iterator[tuple[int, list[str]]]:
        for state, groups in self.db.execute("SELECT state, groups FROM retired ORDER BY rowid"):
            yield state, unpack(groups)

    def retire(self, state: int, group_ids: list[str]) -> None:
        with self.transaction():
            self.db.execute("INSERT INTO retired(state, groups) VALUES (?, ?)", (state, pack(group_ids)))

    def deliver(self, step: int, group_ids: list[str], record: dict[str, Any], meta: dict[str, Any]) -> None:
        with self.transaction():
            for key, value in meta.items():
                self.set_meta(key, value)
            self.db.execute("INSERT OR REPLACE INTO batches(step, groups, committed) VALUES (?, ?, 0)",
                            (step, pack(group_ids)))
            self.db.execute("INSERT OR REPLACE INTO deliveries(step, record) VALUES (?, ?)", (step, pack(record)))

    def deliveries(self) -> Iterator[tuple[int, dict[str, Any], bool]]:
        """(step, record, committed) for every delivered batch, by step; the record as `deliver` got it.
        Batches a broker older than this table delivered have none."""
        try:
            rows = self.db.execute("SELECT d.step, d.record, b.committed FROM deliveries d "
                                   "JOIN batches b ON b.step = d.step ORDER BY d.step").fetchall()
        except sqlite3.OperationalError:  # a catalogue written before deliveries were recorded
            return
        for step, record, committed in rows:
            yield step, unpack(record), bool(committed)

    def was_delivered(self, step: int) -> bool:
        return self.db.execute("SELECT 1 FROM batches WHERE step=?", (step,)).fetchone() is not None

    def commit(self, steps: list[int], committed_step: int) -> None:
        with self.transaction():
            self.db.executemany("UPDATE batches SET committed=1 WHERE step=?", [(s,) for s in steps])
            self.set_meta("committed_step", committed_step)

    # ---- task leases ------------------------------------------------------

    def _columns(self, table: str) -> set[str]:
        return {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}

    def tasks(self) -> Iterator[tuple[int, str | None, str | None, float | None, int, bool, int | None, str | None]]:
        """(seq, lease id, holder, expires, attempt, done, req, session) for every task issued, by seq."""
        kept = "req, session" if "req" in self._columns("tasks") else "NULL, NULL"  # read-only, of an older run
        for seq, lid, holder, expires, attempt, done, req, session in self.db.execute(
                f"SELECT seq, lease_id, holder, expires, attempt, done, {kept} FROM tasks ORDER BY seq"):
            yield seq, lid, holder, expires, attempt, bool(done), req, session

    def lease(self, rows: list[tuple[int, str, str, float, int, int | None, str | None]],
              revisits: list[tuple[int, int]] = ()) -> None:
        """Record leases: (seq, lease id, holder, expires, attempt, req, session); and (revisit row, seq) for each
        waiting revisit issued as a new seq."""
        with self.transaction():
            self.db.executemany("INSERT OR REPLACE INTO tasks(seq, lease_id, holder, expires, attempt, done, req, "
                                "session) VALUES (?, ?, ?, ?, ?, 0, ?, ?)", rows)
            self.db.executemany("UPDATE revisits SET seq=? WHERE rowid=?", [(q, r) for r, q in revisits])

    def task_done(self, seq: int, revisit: tuple[dict[str, Any], int, int] | None = None) -> int | None:
        """Task `seq` has its group; `revisit`: (task, times issued, first batch) to queue it again (its row)."""
        with self.transaction():
            self.db.execute("UPDATE tasks SET done=1, lease_id=NULL, holder=NULL WHERE seq=?", (seq,))
            if revisit is not None:
                task, times, ready = revisit
                return self.db.execute("INSERT INTO revisits(task, times, ready) VALUES (?, ?, ?)",
                                       (pack(task), times, ready)).lastrowid
        return None

    def revisits(self) -> Iterator[tuple[int, dict[str, Any], int, int, int | None]]:
        """(row, task, times, ready, seq) of every revisit, queued or issued, in queue order."""
        for row, task, times, ready, seq in self.db.execute(
                "SELECT rowid, task, times, ready, seq FROM revisits ORDER BY rowid"):
            yield row, unpack(task), times, ready, seq

    def release(self, seqs: list[int]) -> None:
        with self.transaction():
            self.db.executemany("UPDATE tasks SET lease_id=NULL, holder=NULL WHERE seq=?", [(s,) for s in seqs])

    def close(self) -> None:
        if self._wdb is not None:
            self._wdb.close()
        self.db.close()

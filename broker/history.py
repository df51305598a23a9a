"""What the broker gave the trainer, read back from its data directory: the record `rlbus replay` trains on.

Every BATCH the broker delivers is recorded in its catalogue (`deliveries`:
the trajectory ids of each group in the order sent, and the expired and
skipped counts) in the same transaction as the batch itself, and neither the
record nor the payloads are removed after commit. `DeliveredBatches` opens a
data directory read-only (beside a running broker or after it) and rebuilds
each step's BATCH message exactly as it was sent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from rlbus.broker.catalog import FILE as CATALOG_FILE, Catalog
from rlbus.broker.segments import SegmentLog
from rlbus.common import protocol as P


class DeliveredBatches:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.catalog = Catalog(self.dir / CATALOG_FILE, fsync=False, readonly=True)
        self.segments = SegmentLog(self.dir / "segments", fsync=False, segment_bytes=1 << 30)
        self._where: dict[str, tuple[int, int, int, int, dict[str, Any]]] = {}
        for meta, segment, offset, length, crc in self.catalog.placed():
            self._where[meta["id"]] = (segment, offset, length, crc, meta)

    def __iter__(self) -> Iterator[tuple[int, P.Message, bool]]:
        """(step, the BATCH sent for it, committed) for every recorded step, by step."""
        for step, record, committed in self.catalog.deliveries():
            yield step, self.batch(step, record), committed

    def batch(self, step: int, record: dict[str, Any]) -> P.Message:
        groups, payloads = [], []
        for ids in record["trajectories"]:
            metas = []
            for traj_id in ids:
                segment, offset, length, crc, meta = self._where[traj_id]
                payloads.append(self.segments.read(segment, offset, length, crc, f"trajectory {traj_id}"))
                metas.append(meta)
            groups.append({"group_id": metas[0]["group_id"], "batch_index": metas[0]["batch_index"],
                           "trajectories": metas})
        header = {"step": step, "groups": groups, "expired": record["expired"], "skipped": record["skipped"]}
        return P.Message(P.BATCH, header, [b"".join(payloads)])

    def close(self) -> None:
        self.segments.close()
        self.catalog.close()

    def __enter__(self) -> DeliveredBatches:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

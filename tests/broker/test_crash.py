"""Crash safety: SIGKILL the broker under load; every ACKed trajectory survives, once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from rlbus.broker.store import Store
from tests.conftest import REPO


def test_sigkill_broker_while_producers_stream(broker_factory, tmp_path):
    b = broker_factory("buffer.capacity=100000")
    groups = 400
    outs = [tmp_path / f"acked-{i}.txt" for i in range(2)]
    errs = [tmp_path / f"producer-{i}.stderr" for i in range(2)]  # files, not pipes: nothing must block a producer
    producers = [subprocess.Popen([sys.executable, "-m", "tests.helpers.producer", b.address, f"p{i}", str(groups),
                                   str(outs[i])], cwd=REPO, stderr=errs[i].open("wb")) for i in range(2)]
    try:
        # Let them get going, then kill the broker mid-stream.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sum(o.stat().st_size if o.exists() else 0 for o in outs) < 2000:
            time.sleep(0.02)
        acked_before = sum(len(o.read_text().split()) for o in outs if o.exists())
        assert 0 < acked_before < 2 * groups * 4, "the kill must land mid-stream"
        b.kill(signal.SIGKILL)
        time.sleep(0.5)
        b.start()
        for p, err in zip(producers, errs):
            assert p.wait(120) == 0, err.read_text(errors="replace")[-2000:]
    finally:
        for p in producers:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
    b.stop()
    acked = set()
    for o in outs:
        acked.update(o.read_text().split())
    assert len(acked) == 2 * groups * 4, "producers carried on by themselves until everything was ACKed"
    store = Store(b.data_dir, cache_bytes=0)
    try:
        rows = [t.id for g in store.groups.values() for t in g.trajs]
        assert len(rows) == len(set(rows)), "no trajectory stored twice"
        assert acked <= set(rows), "every ACKed trajectory is stored"
        for g in store.groups.values():
            assert len(g.trajs) == g.size
            for t in g.trajs:
                assert store.payload(t).startswith(b"payload-of-" + t.id.encode())
    finally:
        store.close()

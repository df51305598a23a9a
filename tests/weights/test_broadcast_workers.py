"""A broadcast reaches every worker of an explorer whose engine has several (tensor parallel): a rank each.

The real trainer-side sender over gloo and the real receiving code of vLLM's workers (`open_source`), in plain
processes standing in for an engine's two workers and for a one-worker explorer.
"""

from __future__ import annotations

import multiprocessing as mp
import threading

import torch
from hypothesis import given, strategies as st

from rlbus.common import protocol as P
from rlbus.weights.broadcaster import _ranks
from rlbus.weights.sync import broadcast_source
from tests.explorer.test_broadcast_sync import peers, publisher, tiny_weights
from tests.helpers import bcast_member
from tests.helpers.announce import broadcast_publish
from tests.helpers.waiting import wait_for


def test_an_explorer_with_two_workers_takes_a_rank_for_each(broker_factory, clients, tiny_model, tmp_path):
    b = broker_factory("sync.sync_style=async", "sync.max_staleness=100")
    trainer = clients(b, "trainer", "tr")
    caps = {"sync_methods": ["checkpoint", "nccl"], "broadcast_backends": ["gloo"]}
    tp = clients(b, "explorer", "tp", capabilities={**caps, "broadcast_workers": 2})
    clients(b, "explorer", "single", capabilities=caps)
    pub = publisher(tmp_path, tiny_model, timeout_s=60)
    pub.attach(trainer)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = []
    try:
        wait_for(lambda: {"tp", "single"} <= set(peers(trainer)), 30, "both explorers to join")
        model = tiny_weights(tmp_path, tiny_model, 1)
        box: dict = {}
        publishing = threading.Thread(target=lambda: box.update(state=pub.publish(pub.snapshot(model), 1, 0)))
        publishing.start()
        wait_for(lambda: (tp.weights or {}).get("broadcast"), 30, "the announcement")
        ann = tp.weights["broadcast"]
        assert ann["world"] == 4 and ann["workers"] == {"single": 1, "tp": 2}
        assert sorted([ann["ranks"]["single"], ann["ranks"]["tp"], ann["ranks"]["tp"] + 1]) == [1, 2, 3]
        for name, workers in (("tp", 2), ("single", 1)):
            for worker in range(workers):
                p = ctx.Process(target=bcast_member.engine_worker,
                                args=(broadcast_source(ann, ann["ranks"][name]), worker, out))
                p.start()
                procs.append(p)
        got = [out.get(timeout=120) for _ in procs]
        publishing.join(60)
        assert not publishing.is_alive() and pub.comm is not None, "the broadcast finished, nothing aborted"
        assert pub.members == (("single", 1), ("tp", 2)) and not pub.suspects
        want = {n: bcast_member.fingerprint(t.to(torch.float32)) for n, t in model.state_dict().items()
                if n != "lm_head.weight"}
        for _, tensors in got:
            assert {n: tensors[n] for n in want} == want
    finally:
        for p in procs:
            p.kill()
            p.join(10)
        pub.close()


@given(st.dictionaries(st.text("abcdefgh", min_size=1, max_size=4), st.integers(1, 8), min_size=1, max_size=6))
def test_the_ranks_the_trainer_hands_out_are_what_the_broker_admits(workers):
    ranks, world = _ranks(tuple(sorted(workers.items())))
    P.validate(broadcast_publish(world, ranks, workers))
    assert world == 1 + sum(workers.values())

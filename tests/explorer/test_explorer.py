"""The explorer against real vLLM (CPU, tiny model) and a real broker process."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

from rlbus.common import protocol as P
from rlbus.common.config import load_config
from rlbus.common.trajectory import decode_payload
from rlbus.weights.digest import weights_digest
from rlbus.weights.sync import load_checkpoint
from rlbus.explorer.main import Explorer
from tests.helpers.waiting import wait_for


def explorer_config(b, *sets):
    return load_config(None, [f"broker.address={b.address}", f"broker.pub_port={b.pub_port}",
                              "broker.heartbeat_interval_s=0.2", "rollout.repeat=4", "data.batch_tasks=2",
                              "explorer.tasks_per_lease=2", "rollout.max_tokens=8", "rollout.dtype=float32", *sets],
                       environ={})


def fetch_all(trainer, step=0, max_groups=64, **wait):
    """Every ready group at the broker, with decoded payloads; `wait` (min_groups, wait_ms): hold the FETCH until
    that many groups are ready, for groups whose PUT may not be durable yet."""
    reply = trainer.request(P.FETCH, {"step": step, "max_groups": max_groups, **wait})
    assert reply.command == P.BATCH, reply.header
    metas = [t for g in reply.header["groups"] for t in g["trajectories"]]
    return reply.header["groups"], metas, [decode_payload(p) for p in P.split_payloads(metas, reply.payloads)]


def publish(trainer, model_dir, version):
    trainer.request(P.PUBLISH, {"version": version, "method": "checkpoint", "location": str(model_dir),
                                "digest": weights_digest(model_dir), "step": version})


def test_explorer_leases_rolls_out_and_publishes(broker_factory, clients, engine):
    """Groups of `repeat` trajectories arrive with agreeing shapes and finite logprobs <= 0."""
    b = broker_factory("sync.sync_style=async", "sync.max_staleness=4", "rollout.repeat=4", "rollout.max_tokens=8",
                       "data.batch_tasks=2")
    ex = Explorer(explorer_config(b, "sync.sync_style=async"), engine, name="ex-1")
    assert ex.run(max_batches=2) == 2
    trainer = clients(b, "trainer", "tr")
    groups, metas, payloads = fetch_all(trainer)
    assert len(groups) == 4 and all(len(g["trajectories"]) == 4 for g in groups)
    for meta, body in zip(metas, payloads):
        n = len(body["response_ids"])
        assert n == meta["n_tokens"] == len(body["logprobs"]) == len(body["loss_mask"]) >= 1
        assert np.all(np.isfinite(body["logprobs"])) and np.all(body["logprobs"] <= 0)
        assert body["loss_mask"].sum() == n and len(body["prompt_ids"]) > 10
        assert meta["policy_version"] == 0 and meta["explorer"] == "ex-1"
        assert body["reward"] == meta["reward"] in (0.0, 1.0)
        assert set(body["timings"]) == {"queue_s", "generate_s", "reward_s"}


def test_an_explorer_is_refused_by_a_run_of_another_model_and_joins_one_of_its_own(broker_factory, clients, engine,
                                                                                   tiny_model, tmp_path):
    """Its HELLO names the engine's model (`rollout.model`). A run whose trainer has another is no run for it:
    trajectories of one model trained as another's, and then weights of the wrong shapes, which it died loading.
    It is refused before it leases anything, naming the field; on a run of its own model it pins the model."""
    from rlbus.common.client import BrokerError
    from rlbus.weights.models import make_tiny, model_fingerprint

    wider = model_fingerprint(str(make_tiny(tmp_path / "wider", tiny_model, hidden=192)))
    b = broker_factory("rollout.repeat=4", "rollout.max_tokens=8", "data.batch_tasks=2")
    clients(b, "trainer", "tr", rollout={"model": wider})
    with pytest.raises(BrokerError, match=r"rollout\.model: this peer has 'LlamaForCausalLM 2x128 .*, the run "
                                          r"'LlamaForCausalLM 2x192 .*use a new run directory"):
        Explorer(explorer_config(b), engine, name="ex-other").run(max_batches=1)
    tool = clients(b, "tool", "look")
    assert tool.request(P.STATUS).header["tasks"]["leased"] == 0
    own = broker_factory("rollout.repeat=4", "rollout.max_tokens=8", "data.batch_tasks=2")
    assert Explorer(explorer_config(own), engine, name="ex-own").run(max_batches=1) == 1
    pinned = [(e["model"], e["peer"]) for e in own.log_events() if e["event"] == "rollout_model_pinned"]
    assert pinned == [(model_fingerprint(tiny_model), "ex-own")]


def test_behaviour_logprobs_match_a_transformers_forward(engine, tiny_model):
    """The off-policy correction needs vLLM's logprobs to agree with the trainer's; tolerance 2e-3 (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = engine.chat_prompt([{"role": "user", "content": "What is 4 + 4? Answer with just the number."}])
    samples = engine.generate([prompt], n=4, max_tokens=12)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    worst = 0.0
    for s in samples:
        ids = torch.tensor([prompt + s.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1]
        ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
    assert worst < 2e-3, f"max |vLLM - transformers| logprob = {worst}"


def test_new_checkpoint_is_loaded_and_trajectories_carry_its_version(broker_factory, clients, engine, tiny_model,
                                                                     tmp_path):
    """After PUBLISH, the explorer loads the weights (digest checked) and tags trajectories with the version."""
    from rlbus.weights.models import make_tiny

    b = broker_factory("sync.sync_style=async", "sync.max_staleness=8", "rollout.repeat=4", "rollout.max_tokens=8",
                       "data.batch_tasks=2")
    trainer = clients(b, "trainer", "tr")
    v1 = make_tiny(tmp_path / "v1", tiny_model, seed=1)
    publish(trainer, v1, 1)
    ex = Explorer(explorer_config(b, "sync.sync_style=async"), engine, name="ex-2")
    try:
        ex.run(max_batches=1)
        _, metas, _ = fetch_all(trainer)
        assert {m["policy_version"] for m in metas} == {1}
        # Generations really come from the new weights: greedy output equals transformers' on v1.
        import torch
        from transformers import AutoModelForCausalLM

        prompt = engine.chat_prompt([{"role": "user", "content": "Say something."}])
        got = engine.generate([prompt], n=1, temperature=0.0, max_tokens=6)[0][0].token_ids
        model = AutoModelForCausalLM.from_pretrained(v1, dtype=torch.float32)
        want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
        assert got == want[:len(got)]
    finally:
        load_checkpoint(engine, tiny_model, weights_digest(tiny_model), 0)  # leave the shared engine as found


def test_lockstep_explorer_waits_for_the_version_it_needs(broker_factory, clients, engine, tiny_model, tmp_path):
    """Synchronous lockstep (I=1, O=0): batch 1 is generated only after version 1 is published."""
    b = broker_factory("sync.sync_style=lockstep", "sync.sync_interval=1", "sync.sync_offset=0",
                       "rollout.repeat=4", "rollout.max_tokens=8", "data.batch_tasks=2")
    trainer = clients(b, "trainer", "tr")
    ex = Explorer(explorer_config(b), engine, name="ex-3")
    thread = threading.Thread(target=ex.run, kwargs={"max_batches": 2})
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while ex.batches < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        assert ex.batches == 1, "the explorer must not generate batch 1 with version 0"
        # The explorer counts a batch once its PUT is handed to the client; the ACK, and the groups, come later.
        _, metas, _ = fetch_all(trainer, step=0, max_groups=2, min_groups=2, wait_ms=20_000)
        assert {m["batch_index"] for m in metas} == {0}
        trainer.request(P.COMMIT, {"step": 0})
        publish(trainer, tiny_model, 1)  # same bytes, new version: enough for the rule
        thread.join(60)
        assert not thread.is_alive() and ex.batches == 2
        _, metas, _ = fetch_all(trainer, step=1, max_groups=2)
        assert {(m["batch_index"], m["policy_version"]) for m in metas} == {(1, 1)}
        waits = [e for e in b.log_events() if e["event"] == "lease_wait"]
        assert waits and waits[0]["need_version"] == 1
    finally:
        ex.stop()
        thread.join(10)
        load_checkpoint(engine, tiny_model, weights_digest(tiny_model), 0)



def test_an_explorer_whose_bus_is_not_the_brokers_takes_the_version_from_status_and_says_so(
        broker_factory, clients, engine, tiny_model, tmp_path):
    """An explorer given another `broker.pub_port` than the broker's heard no version announced and waited for
    ever, without a word, while the trainer waited for its batch. It now reads STATUS while it waits: a version
    shown twice there and never on its bus is loaded, with a warning naming the setting."""
    from structlog.testing import capture_logs

    from tests.conftest import free_port

    b = broker_factory("sync.sync_style=lockstep", "sync.sync_interval=1", "sync.sync_offset=0",
                       "rollout.repeat=4", "rollout.max_tokens=8", "data.batch_tasks=2")
    trainer = clients(b, "trainer", "tr")
    ex = Explorer(explorer_config(b, f"broker.pub_port={free_port()}"), engine, name="ex-deaf")
    thread = threading.Thread(target=ex.run, kwargs={"max_batches": 2})
    with capture_logs() as logs:
        thread.start()
        try:
            _, metas, _ = fetch_all(trainer, step=0, max_groups=2, min_groups=2, wait_ms=60_000)
            trainer.request(P.COMMIT, {"step": 0})
            publish(trainer, tiny_model, 1)
            thread.join(60)
            assert not thread.is_alive() and ex.batches == 2
        finally:
            ex.stop()
            thread.join(10)
            load_checkpoint(engine, tiny_model, weights_digest(tiny_model), 0)
    _, metas, _ = fetch_all(trainer, step=1, max_groups=2)
    assert {(m["batch_index"], m["policy_version"]) for m in metas} == {(1, 1)}
    warned = [e for e in logs if e["event"] == "weights_not_on_bus"]
    assert [(e["policy_version"], e["bus"]) for e in warned] == [(1, ex.cfg.bus_address())]


def test_an_explorer_waiting_for_weights_stops_once_the_trainer_has_taken_its_last_step(broker_factory, clients,
                                                                                        engine):
    """Lockstep: after batch 0 the explorer waits for version 1. The trainer ends the run instead (its last step
    taken: BYE `finished`); the explorer, waiting for a version that will never come, stops, as does one that
    joins later."""
    b = broker_factory("sync.sync_style=lockstep", "sync.sync_interval=1", "sync.sync_offset=0",
                       "rollout.repeat=4", "rollout.max_tokens=8", "data.batch_tasks=2")
    trainer = clients(b, "trainer", "tr")
    ex = Explorer(explorer_config(b), engine, name="ex-w")
    thread = threading.Thread(target=ex.run)
    thread.start()
    try:
        fetch_all(trainer, step=0, max_groups=2, min_groups=2, wait_ms=60_000)
        wait_for(lambda: any(e["event"] == "lease_wait" and e["peer"] == "ex-w" for e in b.log_events()), 30,
                 "the explorer waiting for version 1")
        trainer.request(P.COMMIT, {"step": 0})
        trainer.close(bye={"finished": True})
        thread.join(30)
        assert not thread.is_alive() and ex.batches == 1
        late = Explorer(explorer_config(b), engine, name="ex-late")
        assert late.run() == 0
        left = [e["peer"] for e in b.log_events() if e["event"] == "peer_left" and e["reason"] == "bye"]
        assert {"ex-w", "ex-late"} <= set(left), "each said BYE"
    finally:
        ex.stop()
        thread.join(10)


@pytest.mark.parametrize("overlap", [False, True])
def test_held_out_evaluation_runs_before_the_batch_or_beside_its_training(broker_factory, clients, engine, tiny_model,
                                                                          overlap):
    """Lockstep: by default version v is evaluated once batch v is leased, before it is rolled out (the trainer
    waits for it); with `explorer.eval_overlap` after batch v is PUT, while the trainer trains on it, still with
    version v."""
    b = broker_factory("sync.sync_style=lockstep", "sync.sync_interval=1", "sync.sync_offset=0",
                       "rollout.repeat=4", "rollout.max_tokens=8", "data.batch_tasks=2")
    trainer = clients(b, "trainer", "tr")
    ex = Explorer(explorer_config(b, "explorer.eval_every=1", "data.eval_size=4",
                                  f"explorer.eval_overlap={str(overlap).lower()}"), engine, name="ex-eval")
    seen, evaluate = [], ex.evaluate

    def recording(force=False, overlapped=False):
        accuracy = evaluate(force, overlapped)
        if accuracy is not None:
            seen.append((ex.engine.version, ex.batches, overlapped))
        return accuracy
    ex.evaluate = recording
    thread = threading.Thread(target=ex.run, kwargs={"max_batches": 2})
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while (ex.batches < 1 or len(seen) < 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        # The explorer counts a batch once its PUT is handed to the client; the ACK, and the groups, come later.
        _, metas, _ = fetch_all(trainer, step=0, max_groups=2, min_groups=2, wait_ms=20_000)
        assert {m["batch_index"] for m in metas} == {0}
        trainer.request(P.COMMIT, {"step": 0})
        publish(trainer, tiny_model, 1)
        thread.join(60)
        assert not thread.is_alive() and ex.batches == 2
        # (version evaluated, batches PUT by then, beside training)
        assert seen == ([(0, 1, True), (1, 2, True)] if overlap else [(0, 0, False), (1, 1, False)])
    finally:
        ex.stop()
        thread.join(10)
        load_checkpoint(engine, tiny_model, weights_digest(tiny_model), 0)

@pytest.mark.parametrize("streaming", [False, True])
def test_the_evaluating_explorer_joining_last_still_takes_a_batch_of_the_first_window(broker_factory, clients,
                                                                                      engine, streaming):
    """Explorers that start together (trainer.wait_for_explorers): the last to join lifts the wait, and the
    evaluating explorer leases before it evaluates (a batch at a time or streaming), so another explorer leasing
    as fast as it may cannot take the whole first staleness window while the evaluation runs (here 2 s; no
    trainer step opens a new one)."""
    b = broker_factory("sync.sync_style=async", "sync.max_staleness=1", "trainer.wait_for_explorers=2",
                       "rollout.repeat=4", "rollout.max_tokens=8", "data.batch_tasks=2")
    other, stop, taken = clients(b, "explorer", "ex-greedy"), threading.Event(), []

    def lease_all() -> None:
        while not stop.is_set():
            reply = other.request(P.LEASE, {"max_tasks": 2, "policy_version": 0})
            taken.extend(t["batch_index"] for t in reply.header.get("tasks", []))
            stop.wait(0.3)
    greedy = threading.Thread(target=lease_all)
    greedy.start()
    ex = Explorer(explorer_config(b, "sync.sync_style=async", "explorer.eval_every=1", "data.eval_size=4",
                                  f"explorer.streaming={str(streaming).lower()}"), engine, name="ex-eval")
    evaluate = ex.evaluate

    def slow(force=False, overlapped=False):
        time.sleep(2)
        return evaluate(force, overlapped)
    ex.evaluate = slow
    thread = threading.Thread(target=ex.run, kwargs={"max_batches": 1})
    try:
        awaited = other.request(P.STATUS, {}).header["explorers_awaited"]
        assert awaited["waiting"] and awaited["joined"] == ["ex-greedy"] and not taken  # the tasks are held back
        thread.start()
        thread.join(40)
        assert not thread.is_alive() and ex.batches == 1, f"the other explorer took batches {taken}, this one none"
    finally:
        stop.set()
        ex.stop()
        greedy.join(10)
        if thread.ident is not None:
            thread.join(10)


def test_trajectory_metadata_passes_the_broker_schema(engine):
    """What the workflow builds is exactly what PUT validation accepts."""
    from rlbus.explorer.rollout import roll_out
    from rlbus.reward.base import resolve

    lease = {"lease_id": "t0.0", "task_id": "arith-0-0", "seq": 0, "batch_index": 0,
             "task": {"prompt": "What is 1 + 1? Answer with just the number.", "answer": "2"}}
    groups = roll_out(engine, [lease], repeat=2, temperature=1.0, top_p=1.0, max_tokens=4,
                         reward_fn=resolve("arith"), reward_name="arith", explorer="x", leased_at=time.monotonic())
    metas = [dict(m) for m, _ in groups[0]]
    frame = P.join_payloads(metas, [p for _, p in groups[0]])
    P.validate(P.Message(P.PUT, {"trajectories": metas}, [frame]))
    assert all(math.isfinite(m["reward"]) for m in metas)


def test_an_explorer_rides_out_a_broker_that_cannot_write_and_stops_with_what_it_could_not_store(
        broker_factory, clients, engine):
    """While the broker cannot write (a file size limit below its segment's end, as a full disk), the explorer
    keeps its PUTs and goes on; once the broker can write again they are stored. Told to stop while the broker
    cannot write, it gives up on what it could not store and stops cleanly, saying so."""
    import resource

    from structlog.testing import capture_logs

    from tests.conftest import traj

    b = broker_factory("sync.sync_style=async", "sync.max_staleness=100", "rollout.repeat=4", "data.batch_tasks=2")
    filler = clients(b, "explorer", "filler")
    filler.put([traj(f"fill.{i}", "fill", 4, payload=bytes(1 << 20)) for i in range(4)], timeout=10)
    full, unlimited = (2 << 20, resource.RLIM_INFINITY), (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    tool = clients(b, "tool", "watch")
    stored = lambda: tool.request(P.STATUS).header["buffer"]["stored"]  # noqa: E731
    refused = lambda: sum(1 for e in b.log_events() if e["event"] == "request_refused"  # noqa: E731
                          and e["code"] == "storage_error" and e["peer"] == "patient")

    resource.prlimit(b.proc.pid, resource.RLIMIT_FSIZE, full)
    ex = Explorer(explorer_config(b, "sync.sync_style=async"), engine, name="patient")
    with capture_logs() as logs:
        runner = threading.Thread(target=ex.run, daemon=True)
        runner.start()
        wait_for(lambda: refused() >= 3, 60, "PUTs refused")
        assert runner.is_alive() and stored() == 4
        resource.prlimit(b.proc.pid, resource.RLIMIT_FSIZE, unlimited)
        wait_for(lambda: stored() >= 4 + 8, 60, "the explorer's groups stored")
        resource.prlimit(b.proc.pid, resource.RLIMIT_FSIZE, full)
        seen = refused()
        wait_for(lambda: refused() > seen, 60, "a PUT refused again")
        ex.stop()
        runner.join(60)
        assert not runner.is_alive()
    gave_up = [e for e in logs if e["event"] == "stopped_with_puts_unstored"]
    assert len(gave_up) == 1 and "storage_error" in gave_up[0]["error"]
    assert any(e["event"] == "broker_storage_error" and e["command"] == "PUT" for e in logs)
    assert "patient" not in {p["name"] for p in tool.request(P.STATUS).header["peers"]}, "it said BYE"


def test_an_explorer_scoring_with_reward_workers_waits_for_one_and_stops_with_its_groups_unscored(
        broker_factory, clients, engine, tmp_path):
    """With `reward.service` and no worker offering it (none started yet, or the only one gone), the explorer
    stopped with the broker's no_service; now it waits for a worker, and its groups are stored once one comes.
    Told to stop while none is there, it stops cleanly and says what it gives up."""
    import os
    import signal
    import subprocess
    import sys

    from structlog.testing import capture_logs

    from tests.conftest import REPO
    from tests.helpers.waiting import wait_for

    b = broker_factory("sync.sync_style=async", "sync.max_staleness=100", "rollout.repeat=4", "data.batch_tasks=2")
    tool = clients(b, "tool", "watch")
    stored = lambda: tool.request(P.STATUS).header["buffer"]["stored"]  # noqa: E731
    unserved = lambda: sum(1 for e in b.log_events()  # noqa: E731
                           if e["event"] == "eval_failed" and e["code"] == "no_service")
    ex = Explorer(explorer_config(b, "sync.sync_style=async", "reward.service=math"), engine, name="waits")
    worker = None
    with capture_logs() as logs:
        runner = threading.Thread(target=ex.run, daemon=True)
        runner.start()
        try:
            wait_for(lambda: unserved() >= 2, 60, "EVALs refused for want of a worker")
            assert runner.is_alive() and stored() == 0
            worker = subprocess.Popen([sys.executable, "-m", "rlbus.cli", "reward", "--broker", b.address, "--name",
                                       "scorer", "--service", "math", "--set", "broker.heartbeat_interval_s=0.2"],
                                      cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "w.log", "w"))
            wait_for(lambda: stored() >= 8, 90, "groups scored by the worker stored")
            worker.send_signal(signal.SIGTERM)  # it says BYE: the service is gone at once
            assert worker.wait(30) == 0
            seen = unserved()
            wait_for(lambda: unserved() > seen, 60, "an EVAL refused again")
            ex.stop()
            runner.join(60)
            assert not runner.is_alive()
        finally:
            if worker is not None and worker.poll() is None:
                os.kill(worker.pid, signal.SIGKILL)
                worker.wait(10)
    gave_up = [e for e in logs if e["event"] == "stopped_with_groups_unscored"]
    assert len(gave_up) == 1 and "no_service" in gave_up[0]["error"], [e["event"] for e in logs][-20:]
    assert any(e["event"] == "reward_service_unavailable" for e in logs)
    assert "waits" not in {p["name"] for p in tool.request(P.STATUS).header["peers"]}, "it said BYE"

"""The trainer against a real broker, on the tiny model."""

from __future__ import annotations

import math
import sqlite3
import time
import zlib
from contextlib import closing

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from rlbus.common import protocol as P
from rlbus.common.client import BrokerClient
from rlbus.common.config import load_config
from rlbus.common.trajectory import encode_payload
from rlbus.weights.sync import load_checkpoint

LOGP = -math.log(49152)  # about what a random tiny model assigns: importance weights near 1


def synthetic(gid: str, version: int = 0, repeat: int = 4, batch: int = 0, seed: int = 0, bad: dict | None = None):
    """A group of trajectories with rewards 0/1 and random tokens; `bad` maps sample index -> a defect."""
    # The same tokens in every session: str's hash is salted per process (PYTHONHASHSEED), so drawing from it made
    # each pytest session train on other data, and a comparison bound that held for most draws failed on some.
    rng = np.random.default_rng(zlib.crc32(f"{gid}/{seed}".encode()))
    items = []
    for i in range(repeat):
        prompt = rng.integers(0, 1000, 10).astype(np.int32)
        resp = rng.integers(0, 1000, 6).astype(np.int32)
        logp = np.full(6, LOGP, dtype=np.float32)
        mask = np.ones(6, dtype=np.uint8)
        defect = (bad or {}).get(i)
        if defect == "nan":
            logp[2] = np.nan
        elif defect == "vocab":
            resp[0] = 10 ** 6
        elif defect == "empty":
            resp, logp, mask = resp[:0], logp[:0], mask[:0]
        elif defect == "lengths":
            logp = logp[:3]
        meta = {"id": f"{gid}.{i}", "group_id": gid, "task_id": gid, "group_size": repeat, "batch_index": batch,
                "policy_version": version, "reward": float(i % 2), "n_tokens": len(resp)}
        items.append((meta, encode_payload({"prompt_ids": prompt, "response_ids": resp, "logprobs": logp,
                                            "loss_mask": mask})))
    return items


def trainer_config(b, tmp_path, *sets):
    return load_config(None, [f"broker.address={b.address}", "broker.heartbeat_interval_s=0.2",
                              f"run.dir={tmp_path}/run", "rollout.repeat=4", "data.batch_tasks=2",
                              "trainer.lr=1e-3", "trainer.micro_batch=3", "trainer.checkpoint_every=0",
                              "trainer.fetch_wait_s=1", "rollout.dtype=float32", *sets], environ={})


def fed_trainer(broker_factory, clients, tiny_model, tmp_path, groups: int, staleness: int, steps: int):
    """An async trainer on a real broker already holding `groups` groups (two per batch index)."""
    from rlbus.trainer.main import Trainer

    b = broker_factory("sync.sync_style=async", f"sync.max_staleness={staleness}", "rollout.repeat=4",
                       "data.batch_tasks=2")
    ex = clients(b, "explorer", "feeder")
    for g in range(groups):
        ex.put(synthetic(f"g{g}", batch=g // 2), timeout=10)
    cfg = trainer_config(b, tmp_path, "sync.sync_style=async", f"sync.max_staleness={staleness}",
                         f"trainer.total_steps={steps}")
    return Trainer(cfg, tiny_model)


@pytest.mark.slow
def test_trainer_steps_publish_and_published_weights_match_in_transformers_and_vllm(
        broker_factory, clients, tiny_model, engine, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlbus.trainer.model import token_logprobs

    trainer = fed_trainer(broker_factory, clients, tiny_model, tmp_path, groups=4, staleness=4, steps=2)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with capture_logs() as logs:
        assert trainer.run() == 2
    steps = [e for e in logs if e["event"] == "train_step"]
    assert [s["step"] for s in steps] == [0, 1] and all(s["published"] for s in steps)
    assert all(s["samples"] == 8 and s["tokens"] == 48 and math.isfinite(s["grad_norm"]) for s in steps)
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    weights = tmp_path / "run" / "weights" / "v2"
    assert (weights / "config.json").exists() and (weights / "tokenizer.json").exists()
    ids = torch.tensor([[1, 5, 9, 200, 31, 7, 42, 8]])
    trainer.model.eval()
    with torch.no_grad():
        mine = trainer.model(ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)(ids).logits
    assert torch.allclose(mine, theirs, atol=1e-5)
    from rlbus.weights.digest import weights_digest

    load_checkpoint(engine, str(weights), weights_digest(weights), 2)
    try:
        sample = engine.generate([ids[0].tolist()], n=1, max_tokens=6)[0][0]
        full = torch.tensor([ids[0].tolist() + sample.token_ids])
        with torch.no_grad():
            ref, _ = token_logprobs(trainer.model, full, torch.ones_like(full))
        want = ref[0, ids.shape[1] - 1:]
        assert torch.allclose(want, torch.tensor(sample.logprobs), atol=2e-3), (want, sample.logprobs)
    finally:
        load_checkpoint(engine, tiny_model, weights_digest(tiny_model), 0)


def test_status_lists_the_trainer_with_the_version_it_holds(broker_factory, clients, tiny_model, tmp_path):
    """The trainer's HEARTBEATs carry the version of its weights after each step, so STATUS shows it, not the
    version it started with."""
    trainer = fed_trainer(broker_factory, clients, tiny_model, tmp_path, groups=4, staleness=4, steps=2)
    tool = BrokerClient(trainer.cfg.broker.address, "tool", "look")
    tool.start(10)
    trainer.connect()
    try:
        for _ in range(2):
            assert trainer.run_step()
        deadline = time.monotonic() + 10
        while trainer_version(tool) != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert trainer_version(tool) == 2
    finally:
        trainer.client.close(bye=True)
        trainer.close()
        tool.close(bye=True)


def trainer_version(tool) -> int:
    return next(p["policy_version"] for p in tool.request(P.STATUS).header["peers"] if p["role"] == "trainer")


def test_stale_trajectories_are_never_trained_on(broker_factory, clients, tiny_model, tmp_path):
    from rlbus.trainer.main import Trainer

    b = broker_factory("sync.sync_style=async", "sync.max_staleness=1", "rollout.repeat=4", "data.batch_tasks=2")
    ex = clients(b, "explorer", "feeder")
    for v in (0, 1, 2, 3):
        ex.put(synthetic(f"v{v}", version=v), timeout=10)
    cfg = trainer_config(b, tmp_path, "sync.sync_style=async", "sync.max_staleness=1", "trainer.total_steps=4",
                         "data.batch_tasks=4")
    trainer = Trainer(cfg, tiny_model)
    trainer.step = trainer.version = 3  # as if resumed at step 3
    with capture_logs() as logs:
        trainer.run(max_steps=1)
    step = next(e for e in logs if e["event"] == "train_step")
    assert step["staleness"] == {"0": 4, "1": 4}, "only versions 2 and 3 are within 1 of step 3"
    assert step["groups_expired"] == 2


def test_bad_trajectories_are_rejected_with_reasons_and_training_goes_on(broker_factory, clients, tiny_model, tmp_path):
    from rlbus.trainer.main import Trainer

    b = broker_factory("sync.sync_style=async", "sync.max_staleness=4", "rollout.repeat=4", "data.batch_tasks=2")
    ex = clients(b, "explorer", "feeder")
    ex.put(synthetic("bad1", bad={0: "nan", 1: "vocab"}), timeout=10)
    ex.put(synthetic("bad2", bad={2: "empty", 3: "lengths"}), timeout=10)
    ex.put(synthetic("good1", batch=1) + synthetic("good2", batch=1), timeout=10)
    cfg = trainer_config(b, tmp_path, "sync.sync_style=async", "sync.max_staleness=4", "trainer.total_steps=2")
    trainer = Trainer(cfg, tiny_model)
    with capture_logs() as logs:
        assert trainer.run() == 2
    reasons = {e["reason"] for e in logs if e["event"] == "trajectory_rejected"}
    assert reasons == {"non-finite logprobs", "token ids outside the vocabulary [0, 49152)", "empty response",
                       "lengths differ: response 6, logprobs 3, loss_mask 6"}
    steps = [e for e in logs if e["event"] == "train_step"]
    assert steps[0]["samples"] == 4 and sum(steps[0]["rejected"].values()) == 4
    assert steps[1]["samples"] == 8 and not steps[1]["rejected"]


def test_nothing_to_train_still_counts_as_the_step(broker_factory, clients, tiny_model, tmp_path):
    """Lockstep: an all-zero-spread batch produces no update, but the version moves so explorers never stall,
    and the learning-rate schedule moves with the step (a run that skips steps still decays to its floor)."""
    from rlbus.trainer.main import Trainer

    b = broker_factory("sync.sync_style=lockstep", "rollout.repeat=4", "data.batch_tasks=1")
    ex = clients(b, "explorer", "feeder")
    lease = ex.request(P.LEASE, {"max_tasks": 1, "policy_version": 0}).header["tasks"][0]
    flat = [(dict(m, reward=1.0), p) for m, p in synthetic(lease["lease_id"], batch=0)]
    ex.put(flat, timeout=10)
    cfg = trainer_config(b, tmp_path, "trainer.total_steps=1", "data.batch_tasks=1", "trainer.lr_schedule=linear")
    trainer = Trainer(cfg, tiny_model)
    assert trainer.scheduler.get_last_lr() == [cfg.trainer.lr]
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with capture_logs() as logs:
        trainer.run()
    step = next(e for e in logs if e["event"] == "train_step")
    assert step["samples"] == 0 and step["groups_dropped"] == 1 and step["new_version"] == 1
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert clients(b, "tool", "t").weights["version"] == 1
    assert trainer.scheduler.last_epoch == trainer.step == 1 and trainer.scheduler.get_last_lr() == [0.0]


def test_first_step_waits_for_the_explorers_it_was_told_of(broker_factory, clients, tiny_model, tmp_path):
    """trainer.wait_for_explorers (the broker's: the trainer's own config does not say it): no step before that
    many explorers have joined, even with a batch's groups already stored; one that joins late is waited for."""
    import threading

    from rlbus.trainer.main import Trainer

    b = broker_factory("sync.sync_style=async", "sync.max_staleness=4", "rollout.repeat=4", "data.batch_tasks=2",
                       "trainer.wait_for_explorers=2")
    ex = clients(b, "explorer", "early")
    ex.put(synthetic("g1") + synthetic("g2"), timeout=10)
    cfg = trainer_config(b, tmp_path, "sync.sync_style=async", "sync.max_staleness=4", "trainer.total_steps=1")
    trainer = Trainer(cfg, tiny_model)
    with capture_logs() as logs:

        def join_once_waited_for():  # the late explorer joins once the trainer has said it waits, however slow it is
            deadline = time.monotonic() + 30
            while not any(e["event"] == "waiting_for_explorers" for e in list(logs)):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)
            clients(b, "explorer", "late")

        late = threading.Thread(target=join_once_waited_for, daemon=True)
        late.start()
        assert trainer.run() == 1
        late.join(timeout=10)
    names = [e["event"] for e in logs]
    waiting = next(e for e in logs if e["event"] == "waiting_for_explorers")
    joined = next(e for e in logs if e["event"] == "explorers_joined")
    assert waiting["explorers"] == ["early"] and joined["explorers"] == ["early", "late"]
    assert names.index("waiting_for_explorers") < names.index("explorers_joined") < names.index("train_step")


def test_a_missing_explorer_is_waited_for_only_so_long(broker_factory, clients, tiny_model, tmp_path):
    from rlbus.trainer.main import Trainer

    b = broker_factory("sync.sync_style=async", "sync.max_staleness=4", "rollout.repeat=4", "data.batch_tasks=2",
                       "trainer.wait_for_explorers=2", "trainer.wait_for_explorers_s=1")
    ex = clients(b, "explorer", "only")
    ex.put(synthetic("g1") + synthetic("g2"), timeout=10)
    cfg = trainer_config(b, tmp_path, "sync.sync_style=async", "sync.max_staleness=4", "trainer.total_steps=1")
    trainer = Trainer(cfg, tiny_model)
    with capture_logs() as logs:
        assert trainer.run() == 1
    names = [e["event"] for e in logs]
    assert names.index("explorers_missing") < names.index("train_step")
    missing = next(e for e in logs if e["event"] == "explorers_missing")
    assert missing["explorers"] == ["only"] and missing["expected"] == 2
    assert any(e["event"] == "train_step" and e["samples"] == 8 for e in logs)


def test_a_trainer_closed_leaves_no_thread_of_its_own(tiny_model, tmp_path):
    """A trainer used without `run` (steps by hand, as in the tests here) is closed by its user: its weight
    server's thread ends, as it does when `run` ends."""
    import threading

    from rlbus.trainer.main import Trainer

    def own() -> set[threading.Thread]:  # (libraries may start threads of their own as the model loads)
        return {t for t in threading.enumerate() if t.name.startswith(("weight", "rlbus"))}

    before = own()
    cfg = load_config(None, [f"run.dir={tmp_path}/run", "rollout.dtype=float32"], environ={})
    trainer = Trainer(cfg, tiny_model)
    assert "weight-server" in {t.name for t in own() - before}
    trainer.close()
    assert own() == before


def test_batch_loss_denominator_counts_the_all_equal_groups_left_out(tiny_model, tmp_path):
    """`algorithm.loss_denominator: batch`: a step on 12 trained samples of a 32-sample batch (20 in all-equal
    groups the broker skipped) has the loss and gradient of the trained-only step times 12/32."""
    from tests.trainer.test_packing import example
    from rlbus.trainer.main import Trainer

    batch = example(seed=5)
    assert batch.size == batch.fetched_samples == 12
    grads = {}
    for denominator, skipped in (("trained", 20), ("batch", 20), ("batch", 0)):
        cfg = load_config(None, [f"run.dir={tmp_path}/run", "trainer.lr=1e-3", "trainer.micro_batch=12",
                                 f"algorithm.loss_denominator={denominator}", "rollout.dtype=float32"], environ={})
        with closing(Trainer(cfg, tiny_model)) as trainer:
            metrics = trainer.train_on(batch, skipped=skipped)
        grads[denominator, skipped] = (metrics["loss"], metrics["grad_norm"])
    loss, norm = grads["trained", 20]
    assert grads["batch", 0] == (pytest.approx(loss, rel=1e-5), pytest.approx(norm, rel=1e-4)), "nothing skipped"
    assert grads["batch", 20][0] == pytest.approx(loss * 12 / 32, rel=1e-5)
    assert grads["batch", 20][1] == pytest.approx(norm * 12 / 32, rel=1e-4)


def test_training_waits_while_two_versions_are_still_to_be_published(broker_factory, clients, tiny_model, tmp_path):
    """A trainer that outpaces its publishing holds at most two versions back (each a copy of the weights):
    with the first publish held, steps 0 and 1 train, step 2 waits, and goes on once it is released."""
    import threading

    from rlbus.trainer.main import MAX_PENDING_PUBLISHES

    assert MAX_PENDING_PUBLISHES == 2
    trainer = fed_trainer(broker_factory, clients, tiny_model, tmp_path, groups=8, staleness=8, steps=4)
    sender, gate, order = trainer.publisher, threading.Event(), []

    class HeldFirst:  # the real sender, its first publish held until the test lets it go
        def __getattr__(self, name):
            return getattr(sender, name)

        def publish(self, snapshot, version, step):
            if version == 1:
                gate.wait(60)
            return sender.publish(snapshot, version, step)

    trainer.publisher = HeldFirst()
    done = []
    runner = threading.Thread(target=lambda: done.append(trainer.run()))
    with capture_logs() as logs:
        runner.start()
        try:
            for _ in range(600):
                if any(e["event"] == "publish_backlog_wait" for e in logs):
                    break
                runner.join(0.1)
            order = [e["event"] if e["event"] != "train_step" else e["step"] for e in logs
                     if e["event"] in ("train_step", "publish_backlog_wait")]
        finally:
            gate.set()
            runner.join(120)
    assert order == [0, 1, "publish_backlog_wait"], order
    wait = next(e for e in logs if e["event"] == "publish_backlog_wait")
    assert (wait["policy_version"], wait["pending"]) == (3, 2)
    assert done == [4] and [e["step"] for e in logs if e["event"] == "train_step"] == [0, 1, 2, 3]
    assert all((tmp_path / "run" / "weights" / f"v{v}").exists() for v in (2, 3, 4))


# bfloat16 units, the timing's figures (ms of a product in bfloat16, in float32): whether auto takes bfloat16
HOSTS = {"amx": (["amx"], 2.0, 8.0, True), "avx512_bf16_faster": (["avx512_bf16"], 6.0, 10.0, True),
         "avx512_bf16_slower": (["avx512_bf16"], 7.4, 4.4, False), "none": ([], 0.0, 0.0, False)}


@pytest.mark.parametrize("host", HOSTS)
def test_autocast_auto_takes_bfloat16_only_where_the_cpu_computes_faster_in_it(cpu_timed, host):
    from rlbus.trainer.model import autocast_dtype

    units, bf16_ms, f32_ms, faster = HOSTS[host]
    cpu_timed(units, bf16_ms, f32_ms)
    cpu = torch.device("cpu")
    assert autocast_dtype("auto", cpu) == (torch.bfloat16 if faster else None)
    assert autocast_dtype("off", cpu) is None and autocast_dtype("bfloat16", cpu) == torch.bfloat16


@pytest.mark.parametrize("host", HOSTS)
def test_rollout_dtype_auto_takes_bfloat16_only_where_the_host_computes_faster_in_it(cpu_timed, host):
    from rlbus.common.config import load_config
    from rlbus.weights.models import rollout_dtype, with_rollout_dtype

    units, bf16_ms, f32_ms, faster = HOSTS[host]
    cpu_timed(units, bf16_ms, f32_ms)
    cfg = load_config(None, [], environ={})
    resolved = with_rollout_dtype(cfg)
    assert resolved.rollout.dtype == ("bfloat16" if faster else "float32") and cfg.rollout.dtype == "auto"
    explicit = load_config(None, ["rollout.dtype=float16"], environ={})
    assert with_rollout_dtype(explicit) is explicit and rollout_dtype("float16") == "float16"


def test_the_trainer_says_what_autocast_auto_chose_and_records_it_for_replay(broker_factory, clients, tiny_model,
                                                                              tmp_path):
    import json

    from rlbus.trainer.checkpoint import RECORD, write_record
    from rlbus.trainer.main import Trainer
    from rlbus.trainer.model import autocast_dtype
    from rlbus.weights.models import rollout_dtype

    b = broker_factory("rollout.repeat=4", "data.batch_tasks=2")
    here = autocast_dtype("auto", torch.device("cpu"))
    with capture_logs() as logs, closing(Trainer(trainer_config(b, tmp_path, "trainer.autocast=auto",
                                                                "rollout.dtype=auto"), tiny_model)) as trainer:
        write_record(trainer.cfg, tiny_model, 0, trainer.autocast_name)
    chose = next(e for e in logs if e["event"] == "trainer_autocast")
    assert chose["dtype"] == ("bfloat16" if here else "off") and trainer.autocast == here
    record = json.loads((tmp_path / "run" / RECORD).read_text())
    # Both as this host resolved them: a replay elsewhere trains and publishes as the run did.
    assert record["autocast"] == chose["dtype"] and record["config"]["rollout"]["dtype"] == rollout_dtype("auto")


def test_a_trainer_is_refused_by_a_run_of_another_model_and_pins_its_own_on_a_fresh_one(broker_factory, clients,
                                                                                      tiny_model, tmp_path):
    """Its HELLO names its model (`rollout.model`): an explorer of another model that joined first holds the run,
    and the trainer is refused naming the field; on a fresh run the trainer's model is the run's."""
    from rlbus.common.client import BrokerError
    from rlbus.trainer.main import Trainer
    from rlbus.weights.models import make_tiny, model_fingerprint

    deeper = model_fingerprint(str(make_tiny(tmp_path / "deeper", tiny_model, layers=3)))
    taken = broker_factory("rollout.repeat=4", "data.batch_tasks=2")
    clients(taken, "explorer", "first", rollout={"model": deeper})
    with closing(Trainer(trainer_config(taken, tmp_path / "a"), tiny_model)) as trainer:
        with pytest.raises(BrokerError, match=r"rollout\.model: this peer has 'LlamaForCausalLM 2x128 .*, the run "
                                              r"'LlamaForCausalLM 3x128 "):
            trainer.connect()
    fresh = broker_factory("rollout.repeat=4", "data.batch_tasks=2")
    with closing(Trainer(trainer_config(fresh, tmp_path / "b"), tiny_model)) as trainer:
        trainer.connect()
        trainer.client.close(bye=False, timeout=1)
    pinned = [(e["model"], e["peer"]) for e in fresh.log_events() if e["event"] == "rollout_model_pinned"]
    assert pinned == [(model_fingerprint(tiny_model), "trainer")]


def test_dr_grpo_aggregation_divides_each_sequences_token_sum_by_the_runs_max_tokens(tiny_model, tmp_path):
    """`seq-mean-token-sum-norm`: a step's loss and gradient are those of `seq-mean-token-sum` over
    rollout.max_tokens, whatever the micro-batch."""
    from tests.trainer.test_packing import example
    from rlbus.trainer.main import Trainer

    batch = example(seed=5)
    figures = {}
    for aggregation, micro in (("seq-mean-token-sum", 12), ("seq-mean-token-sum-norm", 12),
                               ("seq-mean-token-sum-norm", 5)):
        cfg = load_config(None, [f"run.dir={tmp_path}/run", "trainer.lr=1e-3", f"trainer.micro_batch={micro}",
                                 f"algorithm.aggregation={aggregation}", "rollout.max_tokens=40",
                                 "rollout.dtype=float32"], environ={})
        with closing(Trainer(cfg, tiny_model)) as trainer:
            metrics = trainer.train_on(batch)
        figures[aggregation, micro] = (metrics["loss"], metrics["grad_norm"])
    loss, norm = figures["seq-mean-token-sum", 12]
    for micro in (12, 5):
        assert figures["seq-mean-token-sum-norm", micro][0] == pytest.approx(loss / 40, rel=1e-4)
        assert figures["seq-mean-token-sum-norm", micro][1] == pytest.approx(norm / 40, rel=1e-3)


def test_a_trainer_whose_taskset_runs_out_before_its_last_step_ends_the_run(broker_factory, clients, tiny_model,
                                                                             tmp_path):
    """Two tasks, batches of two, total_steps 5: the trainer trains step 0, is told the taskset is exhausted, and
    ends the run (BYE `finished`) instead of waiting for ever for step 1's batch. Step 0 is the run's last: its
    version is published though `sync_interval` is 2, and it is saved and COMMITted though `checkpoint_every` is 4."""
    from rlbus.trainer.main import Trainer

    path = tmp_path / "tasks.jsonl"
    path.write_text('{"prompt": "1 + 1", "answer": "2"}\n{"prompt": "2 + 2", "answer": "4"}\n')
    finite = ("sync.sync_style=async", "sync.max_staleness=4", "data.taskset=file", f"data.path={path}")
    b = broker_factory(*finite, "rollout.repeat=4", "data.batch_tasks=2")
    ex = clients(b, "explorer", "feeder")
    for lease in ex.request(P.LEASE, {"max_tasks": 2, "policy_version": 0}).header["tasks"]:
        ex.put(synthetic(lease["lease_id"]), timeout=10)
    cfg = trainer_config(b, tmp_path, *finite, "trainer.total_steps=5", "trainer.fetch_wait_s=30",
                         "trainer.checkpoint_every=4", "sync.sync_interval=2")
    with closing(Trainer(cfg, tiny_model)) as trainer, capture_logs() as logs:
        started = time.monotonic()
        assert trainer.run() == 1
    assert time.monotonic() - started < 25, "told at once, not after its 30 s wait"
    assert [e["step"] for e in logs if e["event"] == "taskset_exhausted"] == [1]
    assert [e["policy_version"] for e in logs if e["event"] == "weights_published"] == [1]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000000"]
    db = sqlite3.connect(b.data_dir / "buffer.sqlite3")
    assert list(db.execute("SELECT step, committed FROM batches")) == [(0, 1)]
    db.close()
    assert [e["event"] for e in b.log_events() if e["event"] == "run_finished"] == ["run_finished"]
    done = ex.request(P.LEASE, {"max_tasks": 1, "policy_version": 0})
    assert (done.command, done.header["reason"]) == (P.DONE, "finished")


@pytest.mark.parametrize("epochs, mini_batches, micro, level", [(2, 1, 12, "token"), (1, 3, 12, "token"),
                                                                 (2, 2, 5, "token"), (2, 2, 5, "sequence")])
def test_several_updates_per_batch_are_ppos_loop_written_out(tiny_model, tmp_path, epochs, mini_batches, micro,
                                                             level):
    """`algorithm.epochs` passes of `algorithm.mini_batches` optimizer steps over one batch leave the weights that
    PPO's update loop written out plainly leaves (as verl's update_policy): the old logprobs taken once, before the
    first step; each mini-batch, in order, its own token-mean clipped loss weighted by the truncated importance
    weight old / behaviour, and an AdamW step on the clipped gradient. `sequence`: GSPO's ratio, one a sequence."""
    from transformers import AutoModelForCausalLM
    from tests.trainer.test_packing import example
    from rlbus.trainer.main import Trainer

    batch = example(seed=5)  # 12 samples of 3 prompts
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids, att, mask = batch.input_ids, batch.attention_mask, batch.loss_mask.bool()

    def logp(rows):
        logits = model(input_ids=ids[rows], attention_mask=att[rows]).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[rows, 1:, None]).squeeze(-1)

    with torch.no_grad():
        old = logp(slice(None))
    # the explorer's logprobs a little off the trainer's: importance weights e^0.3 (under the cap) and e^-0.3
    sign = torch.where(torch.arange(len(ids))[:, None] % 2 == 0, 1.0, -1.0)
    batch.behaviour_logprobs = torch.where(mask, old - 0.3 * sign, torch.zeros_like(old))
    cfg = load_config(None, [f"run.dir={tmp_path}/run", "trainer.lr=5e-3", f"trainer.micro_batch={micro}",
                             "trainer.shared_prompt=false", f"algorithm.epochs={epochs}",
                             f"algorithm.mini_batches={mini_batches}", f"algorithm.ratio_level={level}",
                             "rollout.dtype=float32"], environ={})
    with closing(Trainer(cfg, tiny_model)) as trainer:
        metrics = trainer.train_on(batch)
        trained = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=cfg.trainer.weight_decay)
    size = -(-len(ids) // mini_batches)
    clipped = 0
    for _ in range(epochs):
        for lo in range(0, len(ids), size):
            rows = slice(lo, lo + size)
            optimizer.zero_grad()
            log_ratio = logp(rows) - old[rows]
            if level == "sequence":
                m = mask[rows]
                log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1))[:, None].expand_as(log_ratio)
            ratio = torch.exp(log_ratio)
            a = batch.advantages[rows, None]
            weight = torch.exp(old[rows] - batch.behaviour_logprobs[rows]).clamp(max=cfg.algorithm.is_cap)
            per_token = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)) * weight
            loss = per_token[mask[rows]].sum() / mask[rows].sum()
            loss.backward()
            clipped += int(((ratio - 1).abs() > 0.2)[mask[rows]].sum())
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
            optimizer.step()
    assert clipped > 0, "the later steps' ratios leave the clip range: the test sees the proximal policy"
    by_hand = model.state_dict()
    worst = max(float((trained[k] - by_hand[k]).abs().max()) for k in by_hand)
    assert worst < 2e-5, worst
    assert metrics["clip_fraction"] > 0


def test_a_reference_cast_once_trains_bit_for_bit_as_one_autocast_casts_every_step(tiny_model, tmp_path, monkeypatch):
    """Under bfloat16 autocast the frozen reference keeps its linear weights in bfloat16 (`frozen_in`), its
    norms and embedding in float32, and its tied LM head as a copy of its own; two steps with a KL term then give
    the same metrics and weights, bit for bit, as a reference whose weights autocast casts at every forward."""
    import rlbus.trainer.learner as learner
    from tests.trainer.test_packing import example
    from rlbus.trainer.main import Trainer

    cfg = load_config(None, [f"run.dir={tmp_path}/run", "trainer.lr=1e-3", "trainer.micro_batch=12",
                             "trainer.autocast=bfloat16", "algorithm.kl_coef=0.5", "rollout.dtype=float32"], environ={})
    runs = {}
    for cast_once in (True, False):
        if not cast_once:
            monkeypatch.setattr(learner, "frozen_in", lambda model, dtype: None)
        with closing(Trainer(cfg, tiny_model)) as trainer:
            ref = trainer.reference
            dtypes = {name: p.dtype for name, p in ref.named_parameters(remove_duplicate=False)}
            metrics = [trainer.train_on(example(seed=s)) for s in (5, 6)]
            runs[cast_once] = metrics, [p.detach().clone() for p in trainer.model.parameters()], dtypes
    (once, weights_once, dtypes), (every, weights_every, before) = runs[True], runs[False]
    assert set(before.values()) == {torch.float32}
    linear = {name for name, module in ref.named_modules() if isinstance(module, torch.nn.Linear)}
    assert "lm_head" in linear and ref.config.tie_word_embeddings
    for name, dtype in dtypes.items():
        assert dtype == (torch.bfloat16 if name.rpartition(".")[0] in linear else torch.float32), name
    assert every[1]["kl"] > 0
    assert once == every
    assert all(torch.equal(a, b) for a, b in zip(weights_once, weights_every))


def test_a_checkpoint_of_another_model_is_refused_naming_the_model_it_was_trained_on(tiny_model, tmp_path):
    """`rlbus up` again on a run directory, with another model.path: the trainer stopped on a traceback of
    load_state_dict's shape mismatches; it now says which run the directory holds and what to do."""
    from rlbus.common.config import ConfigError
    from rlbus.trainer import checkpoint
    from rlbus.trainer.main import Trainer
    from rlbus.weights.models import make_tiny

    wider = str(make_tiny(tmp_path / "wider", tiny_model, hidden=192))
    cfg = load_config(None, [f"run.dir={tmp_path}/run", "rollout.dtype=float32"], environ={})
    with closing(Trainer(cfg, tiny_model)) as trainer:
        checkpoint.write_record(cfg, tiny_model, 0, "off")
        trainer.save()
    with closing(Trainer(cfg, wider)) as trainer:
        with pytest.raises(ConfigError) as refused:
            trainer.resume()
    assert str(refused.value) == (
        f"cannot resume from {tmp_path}/run/checkpoints/step_00000000: lm_head.weight is [49152, 128] in it and "
        f"[49152, 192] in this model (20 more differ). run.dir {tmp_path}/run holds a run of another model "
        f"({tiny_model}, says trainer.json): give a new run.dir, or that run's model.path")
    with closing(Trainer(cfg, tiny_model)) as trainer:  # the model it was trained on resumes
        trainer.resume()
        assert trainer.step == 1


def test_adamw_steps_fused_when_told_and_a_resumed_trainer_takes_its_own_configs_kernel(tiny_model, tmp_path):
    """`trainer.fused_optimizer` steps AdamW with its fused kernel, false (the default) with torch's default one:
    a step of each moves the weights by lr and leaves them equal to float rounding. A checkpoint's param groups
    name the kernel it was trained with; a trainer resumed from it steps with its own config's."""
    from tests.trainer.test_packing import example
    from rlbus.trainer.main import Trainer

    def config(run: str, fused: bool):
        return load_config(None, [f"run.dir={tmp_path}/{run}", "trainer.lr=1e-3", "trainer.micro_batch=12",
                                  "rollout.dtype=float32", f"trainer.fused_optimizer={str(fused).lower()}"], environ={})

    kernels, weights = {}, {}
    for fused in (True, False):
        with closing(Trainer(config(f"fused-{fused}", fused), tiny_model)) as trainer:
            before = [p.detach().clone() for p in trainer.model.parameters()]
            trainer.train_on(example(seed=5))
            group = trainer.optimizer.param_groups[0]
            kernels[fused] = group["fused"], group["foreach"]
            weights[fused] = [p.detach().clone() for p in trainer.model.parameters()]
            trainer.save()
    assert kernels == {True: (True, None), False: (None, None)}
    assert load_config(None, [], environ={}).trainer.fused_optimizer is False
    moved = max(float((a - b).abs().max()) for a, b in zip(weights[True], before))
    worst = max(float((a - b).abs().max()) for a, b in zip(weights[True], weights[False]))
    assert moved > 5e-4 and worst < 1e-6, (moved, worst)
    for saved, fused in ((True, False), (False, True)):
        with closing(Trainer(config(f"fused-{saved}", fused), tiny_model)) as trainer:
            trainer.resume()
            group = trainer.optimizer.param_groups[0]
            assert trainer.step == 1 and (group["fused"], group["foreach"]) == kernels[fused]
            trainer.train_on(example(seed=6))  # the state the other kernel left steps on
            assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_trainer_device_this_host_cannot_compute_on_is_a_config_error_naming_it():
    import torch

    from rlbus.common.config import ConfigError
    from rlbus.trainer.learner import usable_device

    assert usable_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"trainer.device='tpu' is no torch device"):
        usable_device("tpu")
    if torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"trainer.device='cuda:99': this host has \d+ cuda device"):
            usable_device("cuda:99")
    else:
        with pytest.raises(ConfigError, match=r"trainer.device='cuda': this torch \(.*\) has no cuda device here"):
            usable_device("cuda")

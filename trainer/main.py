"""The trainer process (`rlbus trainer`): fetch by version, step, commit, publish.

Step t (0-based) trains the policy of version t and produces version t + 1:

1. FETCH the batch of step t: in `lockstep` the groups of explorer batch t
   (the broker answers once every task of it is resolved); in `async` up to
   `batch_tasks` groups within the staleness bound, at least `batch_tasks`
   informative ones with `fill_batch`. The broker leaves out stale groups and,
   for group-relative advantages, all-equal-reward ones.
2. Check and pad the trajectories (trainer/batch.py), compute advantages,
   and take one optimizer step over micro-batches with gradient
   accumulation. A batch with nothing left to train on still counts as the
   step (no update), so lockstep explorers are never left waiting.
3. Every `sync_interval` steps publish the weights (a sender of rlbus.weights.sync).
4. Every `checkpoint_every` steps save a training checkpoint and COMMIT the
   steps it covers; a restarted trainer resumes from it and the broker
   re-delivers the batches it had not committed.

One `train_step` log line per step carries the canonical metrics.

For `rlbus replay` the trainer records itself in `RUN_DIR/trainer.json` and,
with `trainer.deterministic`, trains the same batches to the same weights.
"""

from __future__ import annotations

import contextvars
import math
import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import structlog
import torch

from rlbus.common import protocol as P
from rlbus.common.client import BrokerClient, BrokerError, BrokerUnreachable
from rlbus.common.config import RunConfig
from rlbus.common import metrics as metrics_sink, telemetry
from rlbus.common.logging import bind, significant
from rlbus.trainer import checkpoint
from rlbus.trainer.algorithms import LossConfig, lr_factor, policy_loss
from rlbus.trainer.batch import Batch, build_batch, decode_batch
from rlbus.trainer.model import DTYPES, load_model, seed_everything, token_logprobs
from rlbus.trainer.packing import packed_token_logprobs, pack, packs
from rlbus.weights.sync import Sender, make_sender

log = structlog.get_logger()


class Trainer:
    def __init__(self, cfg: RunConfig, model_path: str, publisher: Sender | None = None):
        from transformers import AutoTokenizer

        self.cfg = cfg
        t, a = cfg.trainer, cfg.algorithm
        if t.threads:
            torch.set_num_threads(t.threads)
        if t.deterministic:
            # cuBLAS reads this when CUDA starts; without it deterministic algorithms refuse its GEMMs
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.model_path = model_path
        seed_everything(cfg.rollout.seed)
        self.model = load_model(model_path, cfg)
        self.reference = load_model(model_path, cfg, trainable=False) if a.kl_coef > 0 else None
        tok = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        self.vocab = self.model.config.vocab_size
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, partial(lr_factor, t))
        self.shared_prompt = t.shared_prompt and packs(self.model)
        if t.shared_prompt and not self.shared_prompt:
            log.warning("shared_prompt_unavailable", attention=self.model.config._attn_implementation,
                        note="this attention takes no custom mask: one row per sample")
        if self.shared_prompt and torch.device(t.device).type == "cpu":
            # On CPUs SDPA's kernel gains nothing from a custom mask; plain attention is faster there
            # (packed default-task step, SmolLM2-135M, 2 cores: 3.6 s against 4.65 s, median of 5).
            for model in (self.model, self.reference):
                if model is not None:
                    model.set_attn_implementation("eager")
        self.loss_cfg = LossConfig(a.clip_low, a.clip_high, a.dual_clip, a.is_mode, a.is_cap, a.is_low, a.is_high,
                                   a.kl_coef, a.kl_kind, a.aggregation)
        run_dir = Path(cfg.run.dir)
        self.ckpt_dir = run_dir / "checkpoints"
        self.publisher = publisher or make_sender(cfg, run_dir / "weights", model_path, device=t.device)
        self.step = 0
        self.version = 0
        self.temperature = cfg.rollout.temperature or 1.0
        self._stop = False
        self.client: BrokerClient | None = None
        self.broker_version = 0  # the version the broker announced when this trainer joined
        # One thread: weights are written and PUBLISHed in version order while training goes on.
        self._publish_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlbus-publish")
        self._publishes: list = []

    def stop(self) -> None:
        self._stop = True
        if self.client is not None:
            self.client.stopping()  # a broker that is gone too is not waited for

    # ---- resume -----------------------------------------------------------

    def resume(self) -> None:
        path = checkpoint.latest(self.ckpt_dir)
        if path is None:
            return
        step, version = checkpoint.load(path, self.model, self.optimizer, self.scheduler)
        self.step, self.version = step + 1, version
        log.info("trainer_resumed", checkpoint=str(path), step=self.step, policy_version=version)

    # ---- one step ---------------------------------------------------------

    def fetch(self) -> tuple[P.Message | None, float]:
        c, a = self.cfg, self.cfg.algorithm
        header = {"step": self.step, "max_groups": c.data.batch_tasks, "skip_zero_spread": a.drops_zero_spread(),
                  "wait_ms": int(c.trainer.fetch_wait_s * 1000)}
        if c.sync.sync_style == "lockstep":
            header["batch_index"] = self.step
        else:
            header["min_groups"] = c.data.batch_tasks if a.fill_batch else 1
        started = time.monotonic()
        while not self._stop:
            reply = self._request(P.FETCH, header, timeout=c.trainer.fetch_wait_s + c.trainer.broker_timeout_s)
            if reply.command == P.BATCH:
                return reply, time.monotonic() - started
            waited = time.monotonic() - started
            if c.sync.sync_style == "async" and header["skip_zero_spread"] and waited > a.informative_wait_s:
                header.update(min_groups=1, skip_zero_spread=False)
                log.warning("informative_wait_over", waited_s=round(waited, 1), depth=reply.header.get("depth"),
                            skipped=reply.header.get("skipped"),
                            hint="no informative group arrived in algorithm.informative_wait_s; taking all-equal "
                                 "groups (the reward may have saturated)")
        return None, time.monotonic() - started

    def _autocast(self):
        """Mixed precision for the forward pass (weights and optimizer stay in `model.dtype`)."""
        t = self.cfg.trainer
        kind = torch.device(t.device).type
        return torch.autocast(kind, dtype=DTYPES.get(t.autocast, torch.bfloat16), enabled=t.autocast != "off")

    def train_on(self, batch: Batch, skipped: int = 0) -> dict[str, float]:
        """One optimizer step over the batch, in micro-batches; returns metrics. `skipped`: samples of
        all-equal groups the broker left out of the batch (for `algorithm.loss_denominator: batch`)."""
        self.optimizer.zero_grad(set_to_none=True)
        mb = self.cfg.trainer.micro_batch
        by_tokens = self.cfg.algorithm.aggregation == "token-mean"
        total = batch.tokens if by_tokens else batch.size
        if self.cfg.algorithm.loss_denominator == "batch":
            total *= (batch.fetched_samples + skipped) / batch.size  # the batch's samples, trained or not
        sums: Counter[str] = Counter()
        entropy_sum = 0.0
        forwarded = 0
        for start in range(0, batch.size, mb):
            sl = slice(start, start + mb)
            ids, att = batch.input_ids[sl].to(self.cfg.trainer.device), batch.attention_mask[sl].to(self.cfg.trainer.device)
            mask = batch.loss_mask[sl].to(ids.device)
            if self.shared_prompt:
                packed = pack(batch.input_ids[sl], batch.attention_mask[sl], batch.prompt_lens[sl])
                forwarded += packed.tokens
                logprobs = partial(packed_token_logprobs, packed=packed, input_ids=ids)
            else:
                forwarded += int(att.sum())
                logprobs = partial(token_logprobs, input_ids=ids, attention_mask=att)
            with self._autocast():
                logp, entropy = logprobs(self.model, temperature=self.temperature, with_entropy=True, positions=mask)
                ref = None
                if self.reference is not None:
                    with torch.no_grad():
                        ref, _ = logprobs(self.reference, temperature=self.temperature, positions=mask)
            # One update per batch: the proximal policy is the current one (detached).
            loss, m = policy_loss(logp, logp.detach(), batch.behaviour_logprobs[sl].to(ids.device),
                                  batch.advantages[sl].to(ids.device), mask, self.loss_cfg, ref)
            share = (mask.sum().item() if by_tokens else mask.shape[0]) / max(1, total)
            (loss * share).backward()
            n_tok = mask.sum().item()
            entropy_sum += float((entropy * mask).sum())
            sums["loss"] += loss.item() * share
            for k, v in m.items():
                sums[k] += v * n_tok
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        n = max(1, batch.tokens)
        out = {k: v / n for k, v in sums.items() if k != "loss"}
        out.update(loss=sums["loss"], grad_norm=float(grad_norm), entropy=entropy_sum / n,
                   lr=self.scheduler.get_last_lr()[0], forward_tokens=forwarded)
        return out

    def train_reply(self, reply: P.Message) -> tuple[Batch | None, dict[str, float]]:
        """Decode, check and train on one BATCH (a live step's or a replayed one): the batch and its metrics."""
        samples, rejected = decode_batch(reply, self.vocab, self.cfg.rollout.temperature or None)
        batch = build_batch(samples, rejected, self.cfg.algorithm.advantage, self.cfg.algorithm.drops_zero_spread(),
                            self.pad_id)
        metrics: dict[str, float] = {}
        if batch is not None and batch.size:
            metrics = self.train_on(batch, skipped=reply.header.get("skipped", 0))
        return batch, metrics

    def run_step(self) -> bool:
        """Fetch, train, publish and commit one step; False when stopped."""
        step_started = time.monotonic()
        reply, wait_s = self.fetch()
        if reply is None:
            return False
        compute_started = time.monotonic()
        batch, metrics = self.train_reply(reply)
        compute_s = time.monotonic() - compute_started
        publish_started = time.monotonic()
        self.version = self.step + 1
        published = False
        if self.version % self.cfg.sync.sync_interval == 0:
            self._publish_async(self.version, self.step)
            published = True
        self._checkpoint_and_commit()
        publish_s = time.monotonic() - publish_started
        total_s = time.monotonic() - step_started
        self._log_step(reply, batch, metrics, wait_s, compute_s, publish_s, total_s, published)
        self.step += 1
        bind(step=self.step, policy_version=self.version)
        return True

    def _request(self, command: str, header: dict, timeout: float | None = None) -> P.Message:
        """A request that outlasts a broker restart: past `timeout` it is logged and asked again.

        FETCH (a step has one batch), COMMIT and PUBLISH (the same state again)
        are idempotent, so asking again never trains or publishes twice.
        """
        timeout = timeout or self.cfg.trainer.broker_timeout_s
        while True:
            try:
                return self.client.request(command, header, timeout=timeout)
            except TimeoutError:
                if self._stop:
                    raise
                log.warning("broker_unreachable_waiting", command=command, waited_s=timeout)

    def _publish_async(self, version: int, step: int) -> None:
        """Snapshot the weights now; write, digest and PUBLISH them on the publishing thread, in order."""
        self._check_publishes()
        if version <= self.broker_version:
            # Resumed from a checkpoint older than what the broker already announced: explorers hold
            # weights of the steps this trainer lost, which are newer by number. Publishing resumes
            # with the first version above them (a PUBLISH below the announced one is a conflict).
            log.info("publish_skipped", policy_version=version, announced_version=self.broker_version)
            return
        snapshot = self.publisher.snapshot(self.model)

        def job() -> None:
            started = time.monotonic()
            state = self.publisher.publish(snapshot, version, step)
            try:
                self._request(P.PUBLISH, state)
            except BrokerError as exc:
                if exc.code != "conflict":
                    raise
                log.warning("publish_refused", policy_version=version, reason=exc.message)
                return
            metrics_sink.emit("weights_published", policy_version=version, location=state["location"],
                              seconds=round(time.monotonic() - started, 3))  # written, announced

        # The publishing thread logs with this thread's bound context (component, peer, step).
        self._publishes.append(self._publish_pool.submit(contextvars.copy_context().run, job))

    def _check_publishes(self, wait: bool = False) -> None:
        """Raise the error of a failed publish, if any; with `wait`, wait for all first."""
        still = []
        for future in self._publishes:
            if wait or future.done():
                future.result()
            else:
                still.append(future)
        self._publishes = still

    def _checkpoint_and_commit(self) -> None:
        every = self.cfg.trainer.checkpoint_every
        if every == 0:
            self._request(P.COMMIT, {"step": self.step})
        elif (self.step + 1) % every == 0:
            checkpoint.save(self.ckpt_dir, self.step, self.version, self.model, self.optimizer, self.scheduler,
                            self.cfg.trainer.keep_checkpoints)
            self._request(P.COMMIT, {"step": self.step})

    def _log_step(self, reply, batch, metrics, wait_s, compute_s, publish_s, total_s, published) -> None:
        rewards = batch.rewards if batch is not None else torch.empty(0)
        staleness = Counter(self.step - v for v in (batch.versions if batch is not None else []))
        adv = batch.advantages if batch is not None and batch.size else torch.zeros(1)
        tokens = batch.tokens if batch is not None and batch.size else 0
        repeat = max(1, self.cfg.rollout.repeat)
        have = batch is not None
        metrics_sink.emit(
            "train_step", step=self.step, policy_version=self.step, new_version=self.version,
            groups=batch.groups if have else 0,
            groups_dropped=(batch.dropped_groups if have else 0) + reply.header.get("skipped", 0) // repeat,
            groups_expired=reply.header.get("expired", 0) // repeat,
            samples=batch.size if have else 0, rejected=batch.rejected if have else {},
            reward_mean=round(float(rewards.mean()), 4) if rewards.numel() else None,
            reward_std=round(float(rewards.std()), 4) if rewards.numel() > 1 else None,
            adv_mean=round(float(adv.mean()), 4), adv_std=round(float(adv.std()), 4) if adv.numel() > 1 else 0.0,
            adv_abs_max=round(float(adv.abs().max()), 4),
            **{k: significant(v) for k, v in metrics.items()},
            staleness={str(k): v for k, v in sorted(staleness.items())},
            version_span=batch.version_span if have else [], swapped=batch.swapped if have else 0, tokens=tokens,
            tokens_per_s=round(tokens / compute_s, 1) if compute_s > 0 else 0.0,
            wait_s=round(wait_s, 3), compute_s=round(compute_s, 3), publish_s=round(publish_s, 3),
            step_s=round(total_s, 3), published=published)

    # ---- the process ------------------------------------------------------

    def connect(self) -> None:
        b, r = self.cfg.broker, self.cfg.rollout
        self.client = BrokerClient(b.address, "trainer", self.cfg.trainer.name, bus_address=None,
                                   heartbeat_interval_s=b.heartbeat_interval_s, liveness=b.liveness,
                                   policy_version=self.version, curve_server_key=b.curve_server_key,
                                   curve_client_key=b.curve_client_key,
                                   # what its importance weights and published weights assume: the broker checks
                                   rollout={"temperature": r.temperature, "dtype": r.dtype})
        welcome = self.client.start(timeout=60)
        self.broker_version = welcome["weights"]["version"]
        if self.broker_version > self.version:
            log.warning("trainer_behind_broker", policy_version=self.version, announced_version=self.broker_version,
                        note="resumed from an older checkpoint; versions up to the announced one are not published")
        self.publisher.attach(self.client)
        bind(peer=self.cfg.trainer.name, step=self.step, policy_version=self.version)

    def _stopped_without_broker(self, exc: BrokerUnreachable) -> None:
        """Stopping, and the broker has gone too: what it did not acknowledge (a COMMIT, a PUBLISH) it
        re-delivers or re-announces to the trainer that resumes from the last checkpoint."""
        if not self._stop:
            raise exc
        log.warning("stopped_without_broker", step=self.step, policy_version=self.version, error=str(exc))

    def wait_for_explorers(self) -> None:
        """Before a fresh run's first step: until `trainer.wait_for_explorers` explorers have joined, or
        `trainer.wait_for_explorers_s` has passed (then it starts with those there are, and says so)."""
        t = self.cfg.trainer
        if not t.wait_for_explorers or self.step > 0:
            return
        started = time.monotonic()
        last_log = -math.inf
        while not self._stop:
            status = self._request(P.STATUS, {}).header
            joined = sorted(p["name"] for p in status["peers"] if p["role"] == "explorer")
            waited = time.monotonic() - started
            if len(joined) >= t.wait_for_explorers:
                log.info("explorers_joined", explorers=joined, waited_s=round(waited, 1))
                return
            if waited >= t.wait_for_explorers_s:
                log.warning("explorers_missing", explorers=joined, expected=t.wait_for_explorers,
                            waited_s=round(waited, 1), note="training starts with the explorers there are")
                return
            if waited - last_log >= 10:
                last_log = waited
                log.info("waiting_for_explorers", explorers=joined, expected=t.wait_for_explorers,
                         waited_s=round(waited, 1))
            time.sleep(0.2)

    def run(self, max_steps: int | None = None) -> int:
        self.resume()
        checkpoint.write_record(self.cfg, self.model_path, self.step)
        if self.client is None:
            self.connect()
        done = 0
        try:
            self.wait_for_explorers()
            while not self._stop and self.step < self.cfg.trainer.total_steps and (max_steps is None or done < max_steps):
                if not self.run_step():
                    break
                done += 1
        except BrokerUnreachable as exc:
            self._stopped_without_broker(exc)
        finally:
            try:
                self._check_publishes(wait=True)
            except BrokerUnreachable as exc:
                self._stopped_without_broker(exc)
            finally:
                self.client.close(bye=True)
                self.publisher.close()
        log.info("trainer_stopped", step=self.step, policy_version=self.version)
        return done


def run(cfg: RunConfig) -> None:
    """Entry point of `rlbus trainer`."""
    from rlbus.weights.models import resolve_model

    try:
        trainer = Trainer(cfg, resolve_model(cfg.model.path, cfg.model.cache_dir))
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: trainer.stop())
        with telemetry.start(cfg, "trainer", cfg.trainer.name):
            trainer.run()
    except Exception as exc:  # the log says why the trainer ended, not only stderr
        log.exception("trainer_failed", error=P.brief(exc))
        raise

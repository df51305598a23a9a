"""The trainer process (`rlbus trainer`): fetch by version, step, commit, publish.

Step t (0-based) trains the policy of version t and produces version t + 1:

1. FETCH the batch of step t: in `lockstep` the groups of explorer batch t
   (the broker answers once every task of it is resolved); in `async` up to
   `batch_tasks` groups within the staleness bound, at least `batch_tasks`
   informative ones with `fill_batch`. The broker leaves out stale groups and,
   for group-relative advantages, all-equal-reward ones.
2. Check and pad the trajectories (trainer/batch.py), compute advantages,
   and take one optimizer step (or `algorithm.epochs` × `mini_batches`)
   over micro-batches with gradient accumulation. A batch with nothing left
   to train on still counts as the step (no update), so lockstep explorers
   are never left waiting.
3. Every `sync_interval` steps, and at the run's last step, publish the
   weights (a sender of rlbus.weights.sync).
4. Every `checkpoint_every` steps, and at the run's last step, save a
   training checkpoint and COMMIT the steps it covers; a restarted trainer resumes from it and the broker
   re-delivers the batches it had not committed. A run whose taskset runs out
   before `total_steps` ends with its last step trained published and saved.

One `train_step` log line per step carries the canonical metrics.

For `rlbus replay` the trainer records itself in `RUN_DIR/trainer.json` and,
with `trainer.deterministic`, trains the same batches to the same weights.

With `trainer.world_size` > 1 the same loop runs sharded on every rank
(trainer/distributed.py): rank 0 does the above and hands the others each
step's plan; they train their share and join the collective parts.
"""

from __future__ import annotations

import contextvars
import math
import signal
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import structlog
import torch

from rlbus.common import protocol as P
from rlbus.common.client import BrokerClient, BrokerError, BrokerUnreachable, check_admission
from rlbus.common.config import RunConfig
from rlbus.common import metrics as metrics_sink, telemetry
from rlbus.common.logging import bind
from rlbus.common.processes import failures_logged, freeze_heap, on_stop_signals
from rlbus.trainer import checkpoint, distributed, report
from rlbus.trainer.distributed import Plan, World
from rlbus.trainer.learner import Learner
from rlbus.weights.models import model_fingerprint, with_rollout_dtype
from rlbus.weights.sync import Sender, make_sender

log = structlog.get_logger()

# Versions being written or waiting to be: at this many, training waits for the oldest to be published.
MAX_PENDING_PUBLISHES = 2


class Trainer(Learner):
    """The trainer process: a Learner fed by the broker, publishing its weights."""

    def __init__(self, cfg: RunConfig, model_path: str, publisher: Sender | None = None, world: World | None = None):
        cfg = with_rollout_dtype(cfg)  # the dtype it publishes in, as this host resolves `auto`
        super().__init__(cfg, model_path, world)
        self.publisher = None
        if self.main:
            weights = Path(cfg.run.dir) / "weights"
            self.publisher = publisher or make_sender(cfg, weights, model_path, device=str(self.device))
        # How a sharded trainer publishes: its shards copied, then gathered on every rank's publishing thread.
        self.gathered = distributed.Gathered(self.policy, world, getattr(torch, cfg.rollout.dtype)) if world else None
        self._stop = self.exhausted = False
        self.loose = (-1, False, False)  # the last step trained: (step, version not published, not saved)
        self.client: BrokerClient | None = None
        self.broker_version = 0  # the version the broker announced when this trainer joined
        # One thread: weights are written and PUBLISHed in version order while training goes on.
        self._publish_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlbus-publish")
        self._publishes: list = []

    def close(self) -> None:
        """Stops what publishing started (the weight server and its threads); `run` does so when it ends. A trainer
        used without `run` (a step by hand) is closed by its user."""
        if self.publisher is not None:
            self.publisher.close()
        self._publish_pool.shutdown(wait=False)  # `run` has waited for its publishes; nothing new is taken

    def stop(self) -> None:
        self._stop = True
        if self.client is not None:
            self.client.stopping(give_up=(P.FETCH,))  # a broker gone too, or one holding a FETCH, is not waited for

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
            try:
                reply = self._request(P.FETCH, header, timeout=c.trainer.fetch_wait_s + c.trainer.broker_timeout_s)
            except CancelledError:  # stopped while the broker held it for data
                break
            if reply.command == P.BATCH:
                return reply, time.monotonic() - started
            if reply.header.get("reason") == "exhausted":  # the taskset is done and every group of it trained on
                log.info("taskset_exhausted", step=self.step, total_steps=c.trainer.total_steps)
                self.exhausted = True
                break
            self._tell(Plan("wait"))
            waited = time.monotonic() - started
            if c.sync.sync_style == "async" and header["skip_zero_spread"] and waited > a.informative_wait_s:
                header.update(min_groups=1, skip_zero_spread=False)
                log.warning("informative_wait_over", waited_s=round(waited, 1), depth=reply.header.get("depth"),
                            skipped=reply.header.get("skipped"),
                            hint="no informative group arrived in algorithm.informative_wait_s; taking all-equal "
                                 "groups (the reward may have saturated)")
        return None, time.monotonic() - started

    def run_step(self) -> bool:
        """Fetch, train, publish and commit one step; False when stopped."""
        step_started = time.monotonic()
        reply, wait_s = self.fetch()
        if reply is None:
            return False
        self.version = self.step + 1
        last = self.version == self.cfg.trainer.total_steps
        published = self._publish_due(last)
        every = self.cfg.trainer.checkpoint_every
        saves = every > 0 and (self.version % every == 0 or last)
        if self.world is not None:  # the other ranks train on the same batch: a copy of its frames goes to them
            self._tell(Plan("train", self.step, published, saves, [bytes(f) for f in P.encode(
                reply.command, reply.header, reply.payloads)]))
        compute_started = time.monotonic()
        batch, metrics = self.train_reply(reply)
        # read here, not at the step's line, whose time marks the step's end (rlbus trace): a read takes ~1 ms
        compute_s, core_wait = time.monotonic() - compute_started, self.core_wait.measure()
        publish_started = time.monotonic()
        self._conclude(self.step, published, saves)
        self.loose = (self.step, not published, every > 0 and not saves)
        report.train_step(self.step, self.version, self.cfg.rollout.repeat, reply.header, batch, metrics,
                          wait_s=wait_s, compute_s=compute_s, publish_s=time.monotonic() - publish_started,
                          step_s=time.monotonic() - step_started, published=published, core_wait=core_wait)
        self.step += 1
        self.client.policy_version = self.version  # the weights it holds, as its HEARTBEATs (and STATUS) say
        bind(step=self.step, policy_version=self.version)
        return True

    def _request(self, command: str, header: dict, timeout: float | None = None, training_thread: bool = True
                 ) -> P.Message:
        """A request that outlasts a broker restart: past `timeout` it is logged and asked again.

        FETCH (a step has one batch), COMMIT and PUBLISH (the same state again)
        are idempotent, so asking again never trains or publishes twice. From
        the training thread, a sharded trainer's other ranks hear that rank 0
        is still waiting, so a long outage does not time their collective out.
        """
        timeout = timeout or self.cfg.trainer.broker_timeout_s
        while True:
            try:
                return self.client.request(command, header, timeout=timeout)
            except TimeoutError:
                if self._stop:
                    raise
                log.warning("broker_unreachable_waiting", command=command, waited_s=timeout)
                if training_thread:
                    self._tell(Plan("wait"))

    def _conclude(self, step: int, publish: bool, save: bool) -> None:
        """After a step: publish its version, save a checkpoint; rank 0 then COMMITs what a checkpoint covers."""
        if publish:
            self._publish_async(self.version, step)
        if save:
            self.save(step)
        if self.main and (save or self.cfg.trainer.checkpoint_every == 0):
            self._request(P.COMMIT, {"step": step})

    def finish(self) -> None:
        """The taskset ran out before `total_steps`: the last step trained is published, saved and committed, as a
        run's last step is."""
        step, publish, save = self.loose
        publish = publish and self._publish_due(final=True)
        if step >= 0 and (publish or save):
            self._tell(Plan("finish", step, publish, save))
            self._conclude(step, publish, save)

    def _publish_due(self, final: bool = False) -> bool:
        """Every `sync_interval` steps, and the run's last step."""
        if self.version % self.cfg.sync.sync_interval != 0 and not final:
            return False
        if self.version <= self.broker_version:
            # Resumed from a checkpoint older than what the broker already announced: explorers hold
            # weights of the steps this trainer lost, which are newer by number. Publishing resumes
            # with the first version above them (a PUBLISH below the announced one is a conflict).
            log.info("publish_skipped", policy_version=self.version, announced_version=self.broker_version)
            return False
        return True

    def _publish_async(self, version: int, step: int) -> None:
        """Snapshot the weights now; write, digest and PUBLISH them on the publishing thread, in order.
        Sharded, every rank calls this: each copies its shards now, and the publishing threads gather them."""
        self._check_publishes()
        if len(self._publishes) >= MAX_PENDING_PUBLISHES:
            # Each waiting version holds a copy of the weights, and a trainer that outpaces its publishing
            # would run ever further ahead of what explorers can load: wait for the oldest to go out.
            log.info("publish_backlog_wait", policy_version=version, pending=len(self._publishes))
            while len(self._publishes) >= MAX_PENDING_PUBLISHES:
                self._publishes[0].result()
                self._check_publishes()
        if self.gathered is not None:
            frozen = self.gathered.freeze()
            if not self.main:
                self._publishes.append(self._publish_pool.submit(frozen.drain))
                return
            take = partial(self.publisher.snapshot, frozen)  # gathers: on the publishing thread
        else:
            snapshot = self.publisher.snapshot(self.model)
            take = lambda: snapshot  # noqa: E731

        def job() -> None:
            started = time.monotonic()
            state = self.publisher.publish(take(), version, step)
            try:
                self._request(P.PUBLISH, state, training_thread=False)
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

    # ---- the other ranks ----------------------------------------------------

    def _tell(self, plan: Plan) -> None:
        """Rank 0: hand the other ranks their next instruction (nothing to do on a single process)."""
        if self.world is not None:
            distributed.send(plan, self.world)

    def follow(self) -> bool:
        """A rank other than 0: carry out rank 0's next instruction; False once it says stop."""
        plan = distributed.receive(self.world)
        if plan.op == "wait":
            return True
        if plan.op == "stop":
            return False
        self.step, self.version = plan.step, plan.step + 1
        if plan.op == "train":
            self.train_reply(plan.reply())
        self._conclude(plan.step, plan.publish, plan.checkpoint)
        self.step += 1
        bind(step=self.step, policy_version=self.version)
        return True

    # ---- the process ------------------------------------------------------

    def connect(self) -> None:
        b = self.cfg.broker
        self.client = BrokerClient(b.address, "trainer", self.cfg.trainer.name, bus_address=None,
                                   heartbeat_interval_s=b.heartbeat_interval_s, liveness=b.liveness,
                                   policy_version=self.version, curve_server_key=b.curve_server_key,
                                   curve_client_key=b.curve_client_key,
                                   rollout=rollout_given(self.cfg, self.model_path))
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
        """Before a fresh run's first step, while the broker holds the run's tasks for the explorers it waits for
        (`trainer.wait_for_explorers` in the broker's config; STATUS `explorers_awaited`): says who has joined
        every 10 s, then whether they all came or training starts without some."""
        if self.step > 0:
            return
        started = time.monotonic()
        last_log = -math.inf
        while not self._stop:
            status = self._request(P.STATUS, {}).header
            awaited = status.get("explorers_awaited") or {}
            expected, joined = awaited.get("expected", 0), awaited.get("joined", [])
            waited = time.monotonic() - started
            if not awaited.get("waiting"):
                if status.get("trainer_step", 0) > 0:  # the broker's run is past its start: nothing was awaited
                    return
                if len(joined) < expected:
                    log.warning("explorers_missing", explorers=joined, expected=expected, waited_s=round(waited, 1),
                                note="training starts with the explorers there are")
                elif expected:
                    log.info("explorers_joined", explorers=joined, waited_s=round(waited, 1))
                return
            if waited - last_log >= 10:
                last_log = waited
                log.info("waiting_for_explorers", explorers=joined, expected=expected, waited_s=round(waited, 1))
                self._tell(Plan("wait"))
            time.sleep(0.2)

    def run(self, max_steps: int | None = None) -> int:
        self.resume()
        if not self.main:
            while self.follow():
                pass
            self._check_publishes(wait=True)
            return 0
        checkpoint.write_record(self.cfg, self.model_path, self.step, self.autocast_name)
        if self.client is None:
            self.connect()
        done = 0
        try:
            self.wait_for_explorers()
            while not self._stop and self.step < self.cfg.trainer.total_steps and (max_steps is None or done < max_steps):
                if not self.run_step():
                    break
                done += 1
            if self.exhausted:
                self.finish()
            self._tell(Plan("stop"))  # not after an error: the other ranks may be inside another collective
        except BrokerUnreachable as exc:
            self._stopped_without_broker(exc)
            self._tell(Plan("stop"))
        finally:
            try:
                self._check_publishes(wait=True)
            except BrokerUnreachable as exc:
                self._stopped_without_broker(exc)
            finally:
                over = self.exhausted or self.step >= self.cfg.trainer.total_steps  # explorers are told so
                self.client.close(bye={"finished": True} if over else True)
                self.close()
        log.info("trainer_stopped", step=self.step, policy_version=self.version)
        return done


def rollout_given(cfg: RunConfig, model_path: str) -> dict[str, Any]:
    """What the trainer's importance weights and published weights assume, for the broker to check."""
    r = with_rollout_dtype(cfg).rollout
    return {"temperature": r.temperature, "dtype": r.dtype, "model": model_fingerprint(model_path)}


def run(cfg: RunConfig) -> None:
    """Entry point of `rlbus trainer` on one process, and of each rank of a sharded one (with RANK and
    WORLD_SIZE set: by `rlbus.trainer.ranks` or torchrun)."""
    from rlbus.weights.models import resolve_model

    try:
        with failures_logged("trainer_failed"):
            world = distributed.init(cfg)
            if world is not None:
                bind(rank=world.rank)
            path = resolve_model(cfg.model.path, cfg.model.cache_dir)
            if world is None or world.rank == 0:  # a refusal before the model loads
                check_admission(cfg.broker, rollout_given(cfg, path))
            trainer = Trainer(cfg, path, world=world)
            freeze_heap()
            if trainer.main:
                on_stop_signals(trainer.stop)
                with telemetry.start(cfg, "trainer", cfg.trainer.name):
                    trainer.run()
            else:
                # The other ranks stop when rank 0 says so, at a step's end (a terminal's ^C and hang-up reach every
                # rank); SIGTERM, which only a supervisor sends them, ends them at once.
                for sig in (signal.SIGINT, signal.SIGHUP):
                    signal.signal(sig, signal.SIG_IGN)
                trainer.run()
    finally:
        distributed.close()

"""The explorer process (`rlbus explorer`): lease tasks, roll out, score, PUT.

The loop, once per explorer batch:

1. load the newest published weights if they are newer than the engine's
   (a late joiner so receives the current weights before it generates);
2. LEASE tasks with the engine's policy version. WAIT `version` means the
   sync rules need newer weights than these (lockstep): wait, logged with the
   version awaited, until the bus announces them, load them, lease again;
3. roll the tasks out through the workflow and PUT the groups; the client
   resends until ACKed and holds PUTs while the broker gives no credit.

Heartbeats flow from the client's thread during long generations. On SIGTERM
(or SIGHUP, SIGINT) the explorer finishes the batch in hand, PUTs it, and
says BYE, which releases any lease it still holds; if the broker has gone too
(the whole run is stopping), it exits once the broker has been silent for
`broker.liveness` heartbeats instead of waiting for it.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import Future
from typing import Any

import structlog

from rlbus.common import metrics, protocol as P
from rlbus.common.client import BrokerClient, BrokerUnreachable, default_name
from rlbus.common.config import RunConfig
from rlbus.common.logging import bind
from rlbus.explorer.envs import make_env
from rlbus.explorer.rollout import multi_turn, single_turn
from rlbus.reward.base import from_config
from rlbus.weights.sync import Receiver

log = structlog.get_logger()


class Explorer:
    def __init__(self, cfg: RunConfig, engine, name: str | None = None):
        self.cfg = cfg
        self.engine = engine
        self.name = name or cfg.explorer.name or default_name("explorer")
        self.reward_fn = from_config(cfg.reward)
        self.stop_event = threading.Event()
        self.batches = 0
        self.client: BrokerClient | None = None
        self.evaluated: set[int] = set()
        self.receiver = Receiver(self.name, cfg.fetch_dir(self.name), cfg.explorer.receive,
                                 cfg.explorer.fetch_timeout_s, cfg.broker.curve_client_key)
        self.started_at = time.time()

    def connect(self) -> dict[str, Any]:
        b = self.cfg.broker
        self.client = BrokerClient(b.address, "explorer", self.name, bus_address=self.cfg.bus_address(),
                                   heartbeat_interval_s=b.heartbeat_interval_s, liveness=b.liveness,
                                   policy_version=self.engine.version,
                                   capabilities=self._capabilities(), rollout=self._rollout_given(),
                                   curve_server_key=b.curve_server_key, curve_client_key=b.curve_client_key)
        welcome = self.client.start(timeout=60)
        if self.cfg.reward.service:
            from rlbus.reward.worker import RemoteReward

            self.reward_fn = RemoteReward(self.client, self.cfg.reward.service, self.cfg.reward.eval_timeout_s)
        # The run's rollout settings (the broker refuses an explorer whose own disagree with them).
        self.rollout = welcome["rollout"]
        self.started_at = welcome.get("started_at", self.started_at)
        bind(peer=self.name)
        log.info("explorer_connected", run_id=welcome["run_id"], weights_version=welcome["weights"]["version"],
                 sync=welcome["sync"])
        return welcome

    def _rollout_given(self) -> dict[str, Any]:
        """The rollout settings this explorer was configured with (by file, environment or --set); the
        others it takes from the run. The engine's dtype and seed are always given: the engine uses them."""
        given = self.cfg.rollout.model_fields_set | {"dtype", "seed"}
        return {k: v for k, v in self.cfg.rollout.model_dump().items() if k in given}

    def _capabilities(self) -> dict[str, Any]:
        if self.cfg.explorer.receive != "auto":
            return {"sync_methods": ["checkpoint"]}
        from rlbus.weights.broadcast import resolve_backend, unavailable

        backend = resolve_backend(self.cfg.sync.broadcast_backend)
        reason = unavailable(backend)
        if reason:
            log.warning("broadcast_unavailable", backend=backend, reason=reason)
            return {"sync_methods": ["checkpoint"]}
        return {"sync_methods": ["checkpoint", "nccl"], "broadcast_backends": [backend]}

    def stop(self) -> None:
        self.stop_event.set()
        if self.client is not None:
            self.client.stopping()  # a broker that is gone too is not waited for

    # ---- weights ----------------------------------------------------------

    def _load_newest(self) -> None:
        """Bring the engine to the newest published version (by whichever source the receiver picks)."""
        if self.receiver.load(self.engine, self.client.weights):
            self.client.policy_version = self.engine.version
            bind(policy_version=self.engine.version)

    def _wait_for_version(self, need: int, retry_after: float) -> None:
        log.info("waiting_for_weights", policy_version=self.engine.version, need_version=need)
        started = time.monotonic()
        while not self.stop_event.is_set():
            state = self.client.weights or {}
            if state.get("version", 0) >= need:
                self._load_newest()
                if self.engine.version >= need:
                    break
            self.stop_event.wait(min(0.05, retry_after))
        log.info("weights_wait_over", policy_version=self.engine.version, need_version=need,
                 waited_s=round(time.monotonic() - started, 3))

    # ---- held-out evaluation ----------------------------------------------

    def evaluate(self, force: bool = False) -> float | None:
        """Greedy accuracy on the held-out set with the current weights, logged as `eval`; once per version."""
        every, version = self.cfg.explorer.eval_every, self.engine.version
        if not every or version in self.evaluated or not (force or version % every == 0):
            return None
        from rlbus.common.tasksets import make_taskset

        held_out = make_taskset(self.cfg.data, eval_set=True)
        tasks = [held_out.task(i) for i in range(len(held_out))]
        if not tasks:
            return None
        started = time.monotonic()
        prompts = [self.engine.chat_prompt([{"role": "user", "content": t["prompt"]}]) for t in tasks]
        outs = self.engine.generate(prompts, n=1, temperature=0.0, max_tokens=self.rollout["max_tokens"])
        from rlbus.reward.base import Response

        scores = [self.reward_fn(t, Response(o[0].text, o[0].token_ids)).score for t, o in zip(tasks, outs)]
        accuracy = sum(1 for s in scores if s >= 1.0) / len(scores)
        self.evaluated.add(version)
        metrics.emit("eval", policy_version=version, accuracy=round(accuracy, 4), problems=len(tasks),
                     elapsed_s=round(time.time() - self.started_at, 1), seconds=round(time.monotonic() - started, 2))
        return accuracy

    # ---- the loop ---------------------------------------------------------

    def run(self, max_batches: int | None = None) -> int:
        """Explore until the taskset is done, `max_batches` batches are PUT, or stop(); returns batches PUT."""
        if self.client is None:
            self.connect()
        ecfg = self.cfg.explorer
        pending = []
        try:
            while not self.stop_event.is_set() and (max_batches is None or self.batches < max_batches):
                self._load_newest()
                self.evaluate()
                reply = self.client.request(P.LEASE, {"max_tasks": ecfg.tasks_per_lease,
                                                      "policy_version": self.engine.version}, timeout=None)
                if reply.command == P.DONE:
                    log.info("taskset_done")
                    break
                if reply.command == P.WAIT:
                    h = reply.header
                    if h["reason"] == "version":
                        self._wait_for_version(h["need_version"], h["retry_after_s"])
                    else:
                        self.stop_event.wait(h["retry_after_s"])
                    continue
                leases = reply.header["tasks"]
                leased_at = time.monotonic()
                started = time.monotonic()
                r = self.rollout
                kw = dict(repeat=r["repeat"], temperature=r["temperature"], top_p=r["top_p"],
                          max_tokens=r["max_tokens"], reward_fn=self.reward_fn, reward_name=self.cfg.reward.fn,
                          explorer=self.name, leased_at=leased_at)
                if any("env" in lease["task"] for lease in leases):
                    groups = multi_turn(self.engine, leases, make_env, **kw)
                else:
                    groups = single_turn(self.engine, leases, **kw)
                rollout_s = time.monotonic() - started
                items = [t for g in groups for t in g]
                pending.append(self.client.put_async(items))
                pending = _unacknowledged(pending)
                self.batches += 1
                rewards = [m["reward"] for m, _ in items]
                tokens = sum(m["n_tokens"] for m, _ in items)
                metrics.emit("explorer_batch", batch_index=leases[0]["batch_index"], tasks=len(leases),
                             samples=len(items), policy_version=self.engine.version,
                             reward_mean=round(sum(rewards) / len(rewards), 4),
                             rollout_s=round(rollout_s, 3), tokens=tokens, tokens_per_s=round(tokens / rollout_s, 1))
            for future in pending:
                future.result(timeout=None)
            if self.cfg.explorer.eval_every:  # the newest weights, once more, for the run's last word
                self._load_newest()
                self.evaluate(force=True)
        except BrokerUnreachable as exc:
            if not self.stop_event.is_set():
                raise
            # Stopped with the broker gone: groups not ACKed are not stored; their leases expire at the
            # broker, which hands the tasks out again.
            unacked = sum(1 for f in pending if not f.done() or f.exception() is not None)
            log.warning("stopped_without_broker", puts_unacknowledged=unacked, error=str(exc))
        finally:
            self.client.close(bye=True)
        log.info("explorer_stopped", batches=self.batches)
        return self.batches


def _unacknowledged(puts: list[Future]) -> list[Future]:
    """The PUTs not acknowledged yet; raises the error of one that failed (the list is left as it was)."""
    for future in puts:
        if future.done():
            future.result()
    return [f for f in puts if not f.done()]


def run(cfg: RunConfig) -> None:
    """Entry point of `rlbus explorer`."""
    from rlbus.explorer.engine import Engine
    from rlbus.weights.models import resolve_model

    engine = Engine(resolve_model(cfg.model.path, cfg.model.cache_dir), seed=cfg.rollout.seed,
                    memory_fraction=cfg.explorer.memory_fraction, dtype=cfg.rollout.dtype,
                    core=cfg.explorer.engine_core)
    with engine:
        engine.warm_up()
        explorer = Explorer(cfg, engine)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: explorer.stop())
        explorer.run()

"""The reward worker process (`rlbus reward`): serve reward services to explorers through the broker.

It says HELLO as role `reward` with its services (registered reward names or
dotted paths; `rm` scores with the reward model at `reward.rm_path`, in one
batch per request), then answers every EVAL the broker routes to it with a
RESULT: one `{score, details, reason}` per item, in order. A reward that
raises or returns a non-finite score gives `reward.failure_score` with the
reason (reward/base.py), so one bad item never loses the others.
"""

from __future__ import annotations

import math
import queue
import time
from typing import Any, Callable

import structlog

from rlbus.common import protocol as P, telemetry
from rlbus.common.client import BrokerClient, BrokerError, default_name
from rlbus.common.config import ConfigError, RunConfig
from rlbus.common.logging import bind
from rlbus.common.processes import failures_logged, freeze_heap, on_stop_signals
from rlbus.reward.base import Response, RewardResult, evaluate, from_config, resolve

log = structlog.get_logger()


def _plain(result: RewardResult) -> dict[str, Any]:
    return {"score": result.score, "details": result.details, "reason": result.reason}  # `evaluate` made them plain


class RewardWorker:
    def __init__(self, cfg: RunConfig, services: list[str], name: str | None = None):
        self.cfg = cfg
        self.name = name or default_name("reward")
        from_config(cfg.reward)  # applies the sandbox limits
        self.handlers: dict[str, Callable[[list[dict]], list[dict]]] = {}
        for service in services:
            if service == "rm":
                self.handlers["rm"] = self._rm_handler()
            else:
                fn = resolve(service)
                self.handlers[service] = lambda items, fn=fn, s=service: [
                    _plain(evaluate(fn, it.get("task", {}), Response(it["text"], it.get("token_ids", ())),
                                    cfg.reward.failure_score, s)) for it in items]
        self._stop = False
        self.served, self.jobs, self.scoring_s = 0, 0, 0.0  # responses scored, EVAL jobs, seconds scoring

    def _rm_handler(self) -> Callable[[list[dict]], list[dict]]:
        from rlbus.reward.rm import RewardModel

        path = self.cfg.reward.rm_path
        if not path:
            raise ConfigError("service rm needs reward.rm_path (a sequence-classification model directory)")
        try:
            model = RewardModel(path)
        except (OSError, ValueError) as exc:  # no such directory, no model there, a model of another kind
            raise ConfigError(f"reward.rm_path={path!r}: no sequence-classification model loads from it "
                              f"({str(exc).splitlines()[0][:300]})") from None

        failure = self.cfg.reward.failure_score

        def score(items: list[dict]) -> list[dict]:
            scores = model.score([it.get("task", {}).get("prompt", "") for it in items], [it["text"] for it in items])
            return [{"score": s, "details": {}, "reason": ""} if math.isfinite(s) else
                    {"score": failure, "details": {"raw_score": repr(s)}, "reason": "reward was not a finite number"}
                    for s in scores]

        return score

    def stop(self) -> None:
        self._stop = True

    def collect(self):
        """The worker's counts for Prometheus (`metrics.prometheus_port`)."""
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily("rlbus_reward_scored", "Responses scored", value=self.served)
        yield CounterMetricFamily("rlbus_reward_jobs", "EVAL jobs answered", value=self.jobs)
        yield CounterMetricFamily("rlbus_reward_scoring_seconds", "Seconds spent scoring", value=self.scoring_s)

    def run(self) -> None:
        b = self.cfg.broker
        client = BrokerClient(b.address, "reward", self.name, heartbeat_interval_s=b.heartbeat_interval_s,
                              liveness=b.liveness, capabilities={"services": sorted(self.handlers)},
                              curve_server_key=b.curve_server_key, curve_client_key=b.curve_client_key)
        client.start(timeout=60)
        bind(peer=self.name)
        log.info("reward_worker_ready", services=sorted(self.handlers))
        try:
            while not self._stop:
                try:
                    msg = client.inbox.get(timeout=0.2)
                except queue.Empty:
                    continue
                if msg.command != P.EVAL:
                    continue
                handler = self.handlers.get(msg.header.get("service"))
                items = msg.header.get("items", [])
                if handler is None:
                    results = [{"score": self.cfg.reward.failure_score, "details": {},
                                "reason": f"this worker does not offer {msg.header.get('service')!r}"}] * len(items)
                else:
                    started = time.monotonic()
                    try:
                        results = handler(items)
                    except Exception as exc:  # one job the service could not score: the worker serves the next
                        log.warning("eval_failed_here", service=msg.header.get("service"), job=msg.header.get("job"),
                                    error=repr(exc)[:300])
                        results = [{"score": self.cfg.reward.failure_score, "details": {"error": repr(exc)[:300]},
                                    "reason": "the reward service failed on this job"}] * len(items)
                    self.scoring_s += time.monotonic() - started
                self.served += len(items)  # counted before the answer goes: whoever has it sees the count
                self.jobs += 1
                client.send(P.RESULT, {"job": msg.header["job"], "results": results})
        finally:
            client.close(bye=True)
        log.info("reward_worker_stopped", served=self.served)


class RemoteReward:
    """An explorer's reward that asks reward workers through the broker, one EVAL per batch.

    While no worker offers the service (none started yet, or every one restarting) or none gave a result
    (`eval_failed`), the batch is asked again after a backoff, said in a warning each time, until the explorer
    is stopping: a reward service that comes and goes costs the explorers time, not their work."""

    def __init__(self, client: BrokerClient, service: str, timeout_s: float, backoff_max_s: float = 10.0):
        self.client, self.service, self.timeout_s = client, service, timeout_s
        self.backoff_max_s = backoff_max_s

    def score_batch(self, tasks: list[dict], responses: list[Response]) -> list[RewardResult]:
        items = [{"task": dict(t), "text": r.text, "token_ids": list(r.token_ids)} for t, r in zip(tasks, responses)]
        delay = 0.5
        while True:
            try:
                reply = self.client.request(P.EVAL, {"service": self.service, "items": items}, timeout=None)
                break
            except BrokerError as exc:
                if exc.code not in ("no_service", "eval_failed") or self.client.is_stopping:
                    raise
                log.warning("reward_service_unavailable", service=self.service, code=exc.code,
                            error=str(exc)[:300], retry_in_s=delay)
                deadline = time.monotonic() + delay
                while time.monotonic() < deadline and not self.client.is_stopping:
                    time.sleep(0.05)
                delay = min(2 * delay, self.backoff_max_s)
        return [RewardResult(float(x["score"]), dict(x.get("details") or {}, served_by=reply.header.get("served_by")),
                             x.get("reason", "")) for x in reply.header["results"]]

    def __call__(self, task: dict, response: Response) -> RewardResult:
        return self.score_batch([task], [response])[0]


def run(cfg: RunConfig, services: list[str], name: str | None = None) -> None:
    """Entry point of `rlbus reward`."""
    with failures_logged("reward_failed"):
        worker = RewardWorker(cfg, services, name)
        freeze_heap()  # a reward model's weights and imports
        prometheus = telemetry.start(cfg, "reward", worker.name).prometheus
        if prometheus is not None:
            prometheus.add(worker)
        on_stop_signals(worker.stop)
        worker.run()

"""Metrics beyond the log line: Prometheus `/metrics`, TensorBoard scalars, Weights & Biases.

Each is a sink of `rlbus.common.metrics`: it receives the canonical metrics
events (`train_step`, `weights_published`, `explorer_batch`,
`explorer_groups`, `eval`, `weights_loaded`, `put_acked`) with their values,
as the log line does.
`start(cfg, component, name)` starts those the config asks for in a process:

- Prometheus (`metrics.prometheus_port`, off by default): an HTTP server on
  its own thread serving this process's registry. Event metrics come from
  `EVENT_METRICS`; a process adds its own state with `Prometheus.add` (the
  broker's buffer, the reward worker's counts). Names: README, "Metrics".
- TensorBoard (`metrics.tensorboard`, on): the trainer's step scalars at
  their step and the evaluator's at the policy version it evaluated, under
  `RUN_DIR/tensorboard/<component or peer>/`.
- W&B (`metrics.wandb_project`): the same scalars.

A sink that cannot start, or fails on an event, logs a warning and stops
nothing (the metrics module reports a failing sink once per event).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

import structlog

from rlbus.common import metrics
from rlbus.common.protocol import bracketed

log = structlog.get_logger()

SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STALENESS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)

_ROLLOUT = [  # a batch-at-a-time explorer's `explorer_batch`, a streaming one's `explorer_groups`
    ("rlbus_explorer_policy_version", "gauge", "policy_version", "Policy version the explorer generates with"),
    ("rlbus_explorer_reward_mean", "gauge", "reward_mean", "Mean reward of the last rollout"),
    ("rlbus_explorer_samples_total", "counter", "samples", "Samples generated and scored"),
    ("rlbus_explorer_tokens_total", "counter", "tokens", "Tokens generated"),
    ("rlbus_explorer_rollout_seconds", "histogram", "rollout_s", "Wall time of a rollout"),
    ("rlbus_explorer_core_wait", "gauge", "core_wait", "Share of its threads' time the last rollout waited for a core"),
]
# event -> (metric, kind, field, help); kind: gauge (last value), counter (adds the value), histogram
EVENT_METRICS: dict[str, list[tuple[str, str, str, str]]] = {
    "train_step": [
        ("rlbus_trainer_step", "gauge", "step", "Index of the trainer's last step"),
        ("rlbus_trainer_policy_version", "gauge", "new_version", "Policy version the last step produced"),
        ("rlbus_trainer_reward_mean", "gauge", "reward_mean", "Mean reward of the last step's batch"),
        ("rlbus_trainer_loss", "gauge", "loss", "Loss of the last step"),
        ("rlbus_trainer_grad_norm", "gauge", "grad_norm", "Gradient norm of the last step, before clipping"),
        ("rlbus_trainer_entropy", "gauge", "entropy", "Mean token entropy of the last step"),
        ("rlbus_trainer_tokens_per_second", "gauge", "tokens_per_s", "Trained tokens per second of compute"),
        ("rlbus_trainer_samples_total", "counter", "samples", "Samples trained on"),
        ("rlbus_trainer_tokens_total", "counter", "tokens", "Response tokens trained on"),
        ("rlbus_trainer_step_seconds", "histogram", "step_s", "Wall time of a step"),
        ("rlbus_trainer_fetch_wait_seconds", "histogram", "wait_s", "Time a step waited for its batch"),
        ("rlbus_trainer_publish_seconds", "histogram", "publish_s", "Time a step spent publishing and committing"),
        ("rlbus_trainer_core_wait", "gauge", "core_wait", "Share of its threads' time the last step waited for a core"),
    ],
    "explorer_batch": [
        *_ROLLOUT,
        ("rlbus_explorer_tokens_per_second", "gauge", "tokens_per_s", "Generated tokens per second, last batch"),
    ],
    "explorer_groups": _ROLLOUT,
    "weights_published": [
        ("rlbus_trainer_weights_publish_seconds", "histogram", "seconds",
         "Time to write (or broadcast) a version and announce it (weight sync)"),
    ],
    "weights_loaded": [
        ("rlbus_explorer_weights_load_seconds", "histogram", "seconds", "Time to load a new version (weight sync)"),
    ],
    "put_acked": [
        ("rlbus_explorer_put_ack_seconds", "histogram", "seconds", "From sending a PUT to its ACK"),
    ],
    "eval": [
        ("rlbus_eval_accuracy", "gauge", "accuracy", "Held-out greedy accuracy, last evaluation"),
        ("rlbus_eval_policy_version", "gauge", "policy_version", "Policy version of the last evaluation"),
        ("rlbus_eval_seconds", "histogram", "seconds", "Wall time of an evaluation"),
    ],
}
# Where an event's TensorBoard step comes from: the trainer's step; an evaluation's policy version (= steps done).
TENSORBOARD_STEP = {"train_step": "step", "eval": "policy_version"}


def scalars(values: dict[str, Any], prefix: str) -> dict[str, float]:
    """The finite numbers among an event's values, tagged `prefix/name`."""
    return {f"{prefix}/{k}": float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class Prometheus:
    """This process's metrics on `http://HOST:PORT/metrics`, in a registry of its own."""

    def __init__(self, host: str, port: int):
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry()
        self.server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self.server.server_port
        self._metrics: dict[str, Any] = {}

    def _metric(self, name: str, kind: str, help: str, buckets=SECONDS):
        from prometheus_client import Counter, Gauge, Histogram

        metric = self._metrics.get(name)
        if metric is None:
            if kind == "histogram":
                metric = Histogram(name, help, buckets=buckets, registry=self.registry)
            else:
                metric = (Counter if kind == "counter" else Gauge)(name, help, registry=self.registry)
            self._metrics[name] = metric
        return metric

    def __call__(self, event: str, values: dict[str, Any]) -> None:
        for name, kind, key, help in EVENT_METRICS.get(event, ()):
            value = values.get(key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                continue
            metric = self._metric(name.removesuffix("_total") if kind == "counter" else name, kind, help)
            getattr(metric, {"gauge": "set", "counter": "inc", "histogram": "observe"}[kind])(value)
        if event == "train_step" and isinstance(values.get("staleness"), dict):
            staleness = self._metric("rlbus_trainer_staleness", "histogram",
                                     "Staleness (step - policy version) of each trained sample", STALENESS)
            for lag, n in values["staleness"].items():
                for _ in range(int(n)):
                    staleness.observe(int(lag))

    def add(self, collector) -> None:
        """A collector of this process's own state (prometheus_client's Collector interface)."""
        self.registry.register(collector)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class TensorBoard:
    """TensorBoard event files (tensorboard's own writer, no torch needed)."""

    def __init__(self, logdir: str | Path):
        import tensorboard.summary.writer.event_file_writer  # noqa: F401  (missing: the sink is unavailable)

        self.logdir = Path(logdir)
        self.writer = None  # the file is made with the first scalar: an explorer that never evaluates has none

    def __call__(self, event: str, values: dict[str, Any]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        key = TENSORBOARD_STEP.get(event)
        if key is None or not isinstance(values.get(key), int):
            return
        if self.writer is None:
            self.logdir.mkdir(parents=True, exist_ok=True)
            self.writer = EventFileWriter(str(self.logdir))
        tagged = scalars(values, event)
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in tagged.items()])
        self.writer.add_event(event_pb2.Event(wall_time=time.time(), step=values[key], summary=summary))
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandB:
    def __init__(self, cfg, name: str):
        import wandb

        self.run = wandb.init(project=cfg.metrics.wandb_project, group=cfg.run.name, name=f"{cfg.run.name}/{name}",
                              dir=str(cfg.run.dir), config=cfg.model_dump(mode="json"))

    def __call__(self, event: str, values: dict[str, Any]) -> None:
        if event in TENSORBOARD_STEP:
            self.run.log(scalars(values, event))

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # its service process too


class Started:
    """The sinks `start` started: `prometheus` (or None) takes the process's own collectors."""

    def __init__(self):
        self.sinks: list[Any] = []
        self.prometheus: Prometheus | None = None

    def close(self) -> None:
        for sink in self.sinks:
            metrics.remove_sink(sink)
            sink.close()
        self.sinks.clear()

    def __enter__(self) -> Started:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start(cfg, component: str, name: str | None = None) -> Started:
    """Start the sinks the config asks for in this process (`component`: broker, trainer, explorer, reward;
    `name`: its peer name)."""
    m, name = cfg.metrics, name or component
    makers: list[tuple[str, Callable[[], Any]]] = []
    if m.prometheus_port:
        makers.append(("prometheus", lambda: Prometheus(m.prometheus_host, m.prometheus_port)))
    if component in ("trainer", "explorer"):
        if m.tensorboard:
            makers.append(("tensorboard", lambda: TensorBoard(Path(cfg.run.dir) / "tensorboard" / name)))
        if m.wandb_project:
            makers.append(("wandb", lambda: WandB(cfg, name)))
    started = Started()
    for kind, make in makers:
        try:
            sink = make()
        except Exception as exc:  # a metrics backend never stops a run
            log.warning("metrics_sink_unavailable", sink=kind, error=f"{type(exc).__name__}: {exc}"[:300])
            continue
        metrics.add_sink(sink)
        started.sinks.append(sink)
        if isinstance(sink, Prometheus):
            started.prometheus = sink
            log.info("metrics_serving", url=f"http://{bracketed(m.prometheus_host)}:{sink.port}/metrics")
    return started

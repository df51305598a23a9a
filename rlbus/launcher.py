"""`rlbus up CONFIG`: the whole system on one machine, as child processes.

Everything goes into one run directory: `config.yaml` (the effective config,
which every child reads), `logs/<component>.jsonl` (structured logs) and
`logs/<component>.out` (anything else a child prints), the buffer, the
weights and the checkpoints. With `broker.port` and `broker.pub_port` 0 the
broker binds free ports, which go into `config.yaml` before anything else
starts. Children start in order (broker, trainer, explorers, and with
`reward.service` a reward worker offering that service), each in its own
process group (so stopping one stops its vLLM engine processes too) and, if
configured, pinned to its cores.

While they run, a progress line shows the trainer's step and reward, each
explorer's policy version, the buffer depth and how many explorers are
connected (on a terminal, a live view instead: rlbus/progress.py). With
`metrics.prometheus_port` each child serves `/metrics` on its own port. The run ends when the trainer finishes its steps, on Ctrl-C or
SIGTERM, or when a component fails (`launch.on_crash: stop`; with `restart`
it is started again, up to `launch.max_restarts` times). Stopping sends
SIGTERM to the explorers and the trainer, then the reward worker they may
still ask, then the broker, and SIGKILL to any group still there after a
grace period.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from rlbus.broker import endpoints
from rlbus.common.broker_config import dialled
from rlbus.common.config import ConfigError, LaunchConfig, RunConfig, dump_config, parse_cpus
from rlbus.common.processes import Held, hold_lock, on_stop_signals, terminate_with
from rlbus.logview import events, last_event
from rlbus.progress import RunView, wanted

log = structlog.get_logger()

GRACE_S = 20.0


class BrokerFailed(RuntimeError):
    """The broker of a run did not come up (it exited, or did not serve in time)."""


@dataclass
class Child:
    name: str
    command: str
    cpus: set[int]
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    restarts: int = 0


def check_cores(launch: LaunchConfig) -> None:
    """A component pinned to cores none of which this process may use is a ConfigError naming the setting; one
    pinned to some it may not use runs on the others (as Linux does), said in a warning."""
    have = os.sched_getaffinity(0)
    cores = ", ".join(map(str, sorted(have))) if len(have) <= 16 else f"{len(have)}, {min(have)}-{max(have)}"
    pinned = [("broker_cpus", launch.broker_cpus), ("trainer_cpus", launch.trainer_cpus),
              *((f"explorer_cpus[{i}]", spec) for i, spec in enumerate(launch.explorer_cpus))]
    for name, spec in pinned:
        wanted = parse_cpus(spec)
        if wanted and not wanted & have:
            raise ConfigError(f"launch.{name} = {spec!r}: none of these cores is one this process may use "
                              f"(it may use cores {cores})")
        if wanted - have:
            log.warning("cores_unavailable", setting=f"launch.{name}", cpus=spec, missing=sorted(wanted - have),
                        runs_on=sorted(wanted & have))


def check_eval_overlap(cfg: RunConfig) -> None:
    """`explorer.eval_overlap` where the evaluating explorer and a CPU trainer share cores: a warning, since the
    two then run side by side on the same cores and each slows the other many times over."""
    if not (cfg.explorer.eval_overlap and cfg.explorer.eval_every and cfg.launch.explorers
            and cfg.trainer.device == "cpu"):
        return
    have = os.sched_getaffinity(0)
    trainer = parse_cpus(cfg.launch.trainer_cpus) & have or have
    explorer = (parse_cpus(cfg.launch.explorer_cpus[0]) if cfg.launch.explorer_cpus else set()) & have or have
    if trainer & explorer:
        log.warning("eval_overlap_on_shared_cores", cpus=sorted(trainer & explorer),
                    hint="explorer.eval_overlap runs the held-out evaluation beside training: on cores they share, "
                         "a 2.7 s pass and a 2 s step each took about 66 s on a 2-core host (README); pin them apart "
                         "(launch.trainer_cpus, launch.explorer_cpus) or leave it off")


class Launcher:
    def __init__(self, cfg: RunConfig):
        check_cores(cfg.launch)
        check_eval_overlap(cfg)
        cfg = cfg.model_copy(deep=True)
        self._pin_ports(cfg, cfg.broker.port, cfg.broker.pub_port)  # a port 0 is pinned once the broker has bound one
        if cfg.launch.start_together and not cfg.trainer.wait_for_explorers:
            cfg.trainer.wait_for_explorers = cfg.launch.explorers  # the first step waits for all of them
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        self.logs = self.run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        try:  # before any file of it is written: a second `rlbus up` here would write over the first's config.yaml
            self.lock = hold_lock(self.run_dir / "run.lock")
        except Held as exc:
            raise ConfigError(f"run.dir: {self.run_dir} is the directory of a run in progress (rlbus up, pid "
                              f"{exc.pid}); give another run.dir, or stop that run") from None
        self.snapshot = self.run_dir / "config.yaml"
        self.snapshot.write_text(dump_config(cfg))
        launch, port = cfg.launch, cfg.metrics.prometheus_port

        def metrics_port(offset: int) -> list[str]:  # each child its own /metrics port: broker, trainer, explorers
            return ["--set", f"metrics.prometheus_port={port + offset}"] if port else []

        self.children = [Child("broker", "broker", parse_cpus(launch.broker_cpus), metrics_port(0)),
                         Child("trainer", "trainer", parse_cpus(launch.trainer_cpus), metrics_port(1))]
        for i in range(launch.explorers):
            cpus = parse_cpus(launch.explorer_cpus[i]) if i < len(launch.explorer_cpus) else set()
            # One explorer evaluates on the held-out set: the others only explore.
            extra = ["--name", f"explorer-{i}"] + (["--set", "explorer.eval_every=0"] if i else [])
            self.children.append(Child(f"explorer-{i}", "explorer", cpus, extra + metrics_port(2 + i)))
        if cfg.reward.service:  # the explorers score through a worker: one that offers their service
            self.children.append(Child("reward", "reward", set(), ["--name", "reward", "--service", cfg.reward.service]
                                       + metrics_port(2 + launch.explorers)))
        self._stopping = False
        self.exit_code = 0

    @staticmethod
    def _pin_ports(cfg: RunConfig, port: int, pub_port: int) -> None:
        """Children find the broker on this machine, whatever address it binds."""
        cfg.broker.port, cfg.broker.pub_port = port, pub_port
        if port and pub_port:  # 0: not bound yet, nothing to dial (set again once the broker has bound a port)
            cfg.broker.address = dialled(cfg.broker.host, port)
            cfg.broker.pub_address = dialled(cfg.broker.host, pub_port)

    # ---- children ---------------------------------------------------------

    def _start(self, child: Child) -> None:
        args = [sys.executable, "-m", "rlbus.cli", child.command, str(self.snapshot), *child.extra,
                "--set", "logging.format=json", "--set", f"logging.file={self.logs / (child.name + '.jsonl')}"]
        out = open(self.logs / f"{child.name}.out", "ab")
        cpus = child.cpus
        launcher = os.getpid()

        def prepare() -> None:
            terminate_with(launcher)
            if cpus:
                os.sched_setaffinity(0, cpus)

        child.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True, preexec_fn=prepare)
        out.close()
        log.info("component_started", component=child.name, pid=child.proc.pid, cpus=sorted(cpus) or None)

    def _signal(self, child: Child, sig: int) -> None:
        """SIGTERM to the component itself, so it can stop its engine cleanly; SIGKILL to its whole group."""
        if child.proc is not None and child.proc.poll() is None:
            try:
                if sig == signal.SIGKILL:
                    os.killpg(child.proc.pid, sig)
                else:
                    os.kill(child.proc.pid, sig)
            except ProcessLookupError:
                pass

    def _wait_broker(self, timeout: float = 60.0) -> tuple[int, int]:
        """The ports the broker bound, once it serves."""
        broker = self.children[0]
        try:
            ports = endpoints.bound_ports(self.cfg.buffer_dir(), broker.proc, timeout)
        except TimeoutError as e:
            raise BrokerFailed(f"{e}; see {self.logs}/broker.out") from None
        if ports is None:
            why = self._last_error("broker")
            raise BrokerFailed(f"the broker exited with {broker.proc.returncode}{f': {why}' if why else ''}; "
                               f"see {self.logs}/broker.jsonl")
        return ports

    def _last_error(self, name: str) -> str | None:
        return last_error(self.logs, name)

    def stop(self, *_: object) -> None:
        self._stopping = True

    def _shutdown(self) -> None:
        # Explorers and the trainer first (an explorer finishing its batch may still need the reward worker), then
        # the reward worker, then the broker.
        stages = ([c for c in self.children[1:] if c.command != "reward"],
                  [c for c in self.children if c.command == "reward"], self.children[:1])
        for stage in stages:
            for child in reversed(stage):
                self._signal(child, signal.SIGTERM)
            self._wait_all(stage, GRACE_S)
        for child in self.children:
            if child.proc is not None:
                try:
                    os.killpg(child.proc.pid, signal.SIGKILL)  # the group: engine processes included
                except ProcessLookupError:
                    pass
                child.proc.wait()
                _wait_group_gone(child.proc.pid, GRACE_S)
        log.info("run_stopped", run_dir=str(self.run_dir), exit_code=self.exit_code)

    @staticmethod
    def _wait_all(children: list[Child], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for child in children:
            if child.proc is not None:
                try:
                    child.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass

    # ---- progress ---------------------------------------------------------

    def progress(self) -> dict:
        step = last_event(self.logs / "trainer.jsonl", "train_step") or {}
        versions = {}
        explorers = [c for c in self.children if c.command == "explorer"]
        for child in explorers:
            log_file = self.logs / f"{child.name}.jsonl"
            batch = last_event(log_file, "explorer_batch") or last_event(log_file, "explorer_groups") or {}
            versions[child.name] = batch.get("policy_version")
        broker = last_event(self.logs / "broker.jsonl", field="depth") or {}  # the newest broker event that carries a depth
        alive = sum(1 for c in explorers if c.proc is not None and c.proc.poll() is None)
        evaluated = last_event(self.logs / "explorer-0.jsonl", "eval") or {}
        return {"step": step.get("step"), "reward_mean": step.get("reward_mean"), "explorer_versions": versions,
                "buffer_depth": broker.get("depth"), "explorers_running": alive,
                "accuracy": evaluated.get("accuracy"), "accuracy_version": evaluated.get("policy_version")}

    # ---- the run ----------------------------------------------------------

    def run(self) -> int:
        on_stop_signals(self.stop)  # SIGHUP too: its terminal closed
        log.info("run_starting", run_dir=str(self.run_dir), components=[c.name for c in self.children])
        try:
            self._start(self.children[0])
            try:
                ports = self._wait_broker()
            except BrokerFailed as exc:  # nothing else was started: the reason, without a traceback
                log.error("run_failed", error=str(exc))
                self.exit_code = 1
                return 1
            if not (self.cfg.broker.port and self.cfg.broker.pub_port):
                self._pin_ports(self.cfg, *ports)
                self.snapshot.write_text(dump_config(self.cfg))  # the others, and a restarted broker, read these
            for child in self.children[1:]:
                self._start(child)
            last_status = 0.0
            # On a terminal a live view, elsewhere a progress line every status_interval_s.
            view = RunView(self.cfg.trainer.total_steps) if wanted(self.cfg.logging.format) else None
            interval = 1.0 if view else self.cfg.launch.status_interval_s
            with view or contextlib.nullcontext():
                while not self._stopping:
                    time.sleep(0.2)
                    if self._check_children():
                        break
                    if time.monotonic() - last_status >= interval:
                        last_status = time.monotonic()
                        if view:
                            view.update(self.progress())
                        else:
                            log.info("run_progress", **self.progress())
        finally:
            self._shutdown()
            self.summary()
        return self.exit_code

    def summary(self) -> dict:
        """The run in numbers: held-out accuracy before and after, time to 0.9, reward over the steps."""
        evals = sorted(events(self.logs / "explorer-0.jsonl", "eval"), key=lambda e: e["policy_version"])
        # A step trained again after a resume from a checkpoint is one step: its last training is the one kept.
        trained = {e["step"]: e for e in events(self.logs / "trainer.jsonl", "train_step") if "step" in e}
        steps = [e for _, e in sorted(trained.items()) if e.get("reward_mean") is not None]
        rewards = [e["reward_mean"] for e in steps]
        k = max(1, min(5, len(rewards) // 2))
        reached = [e["elapsed_s"] for e in evals if e["accuracy"] >= 0.9]
        result = {
            "steps": len(trained),
            "accuracy_before": evals[0]["accuracy"] if evals and evals[0]["policy_version"] == 0 else None,
            "accuracy_after": evals[-1]["accuracy"] if evals else None,
            "final_version": evals[-1]["policy_version"] if evals else None,
            "seconds_to_accuracy_0_9": min(reached) if reached else None,
            "accuracy_by_time": [(e["elapsed_s"], e["policy_version"], e["accuracy"]) for e in evals],
            "reward_first_steps": round(sum(rewards[:k]) / k, 4) if rewards else None,
            "reward_last_steps": round(sum(rewards[-k:]) / k, 4) if rewards else None,
            "reward_by_step": [(e["step"], e["reward_mean"]) for e in steps],
        }
        (self.run_dir / "summary.json").write_text(json.dumps(result, indent=2))
        log.info("run_summary", **{k: v for k, v in result.items() if k not in ("reward_by_step", "accuracy_by_time")})
        return result

    def _check_children(self) -> bool:
        """Handle exits; True when the run is over."""
        # One poll each: a trainer that finishes between two polls of it must not read as running, then failed.
        exits = [(child, child.proc.poll()) for child in self.children]
        trainer, trainer_exit = exits[1]
        if trainer_exit == 0:
            log.info("trainer_finished", **self.progress())
            return True
        for child, code in exits:
            if code is None or (child is not trainer and code == 0 and child.command == "explorer"):
                continue
            log.error("component_failed", component=child.name, exit_code=code, error=self._last_error(child.name),
                      log=str(self.logs / f"{child.name}.out"))
            if self.cfg.launch.on_crash == "restart" and child.restarts < self.cfg.launch.max_restarts:
                child.restarts += 1
                self._signal(child, signal.SIGKILL)
                self._start(child)
                continue
            self.exit_code = 1
            return True
        return False


def last_error(logs: Path, name: str) -> str | None:
    """What a component's log last said went wrong (its `error` field, else the event's name), or, where it
    logged no error, the one-line `error: ...` its command printed on the way out (a bad setting found before
    its logging started)."""
    errors = [e for e in events(logs / f"{name}.jsonl") if e.get("level") in ("error", "critical")]
    if errors:
        return str(errors[-1].get("error") or errors[-1]["event"])[:500]
    try:
        with open(logs / f"{name}.out", "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 65536))
            tail = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    said = [line for line in tail if line.startswith("error: ")]
    return said[-1].removeprefix("error: ")[:500] if said else None


def _wait_group_gone(pgid: int, timeout: float) -> None:
    """Until no process of the group is left (killed members take a moment to go), or the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    log.warning("process_group_lingers", pgid=pgid)


def check_inputs(cfg: RunConfig) -> None:
    """What a run reads besides its config, tried before anything starts (ConfigError naming the setting): the
    taskset files, the reward functions, and a reward for each kind of task."""
    from rlbus.common.tasksets import make_taskset
    from rlbus.reward.base import check_kinds, from_config

    from_config(cfg.reward)
    file = cfg.data.taskset == "file"
    for label, eval_set in (("data.path" if file else f"data.taskset {cfg.data.taskset}", False),
                            ("data.eval_path" if file else "the held-out set", True)):
        taskset = make_taskset(cfg.data, eval_set) if not eval_set or cfg.explorer.eval_every else None
        if taskset is not None:
            rows = len(getattr(taskset, "rows", [None]))  # a file's rows; a generated taskset's kind is its own
            check_kinds(cfg.reward, (taskset.task(i) for i in range(rows)), label)


def run(cfg: RunConfig) -> int:
    check_inputs(cfg)
    return Launcher(cfg).run()

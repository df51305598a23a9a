"""Typed configuration for a whole rlbus run, one section per process.

A run is described by one YAML file (see configs/). Any field can be
overridden on the command line with a dotted path (`--set trainer.lr=1e-6`)
and by environment variables (`RLBUS_BROKER__PORT=5555`, double underscore
between levels), so containers can be configured without files. Precedence:
defaults < YAML < environment < `--set`.

Every field has a docstring and a default that works on one machine; a bad
value fails with the field's dotted name, the value and what is allowed.
"""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, Field, ValidationError, model_validator

# The processes' sections live in sections.py (the broker's in broker_config.py, the reward's in reward_config.py)
# and are part of this module's API; the run-wide ones are below.
from rlbus.common.broker_config import BrokerConfig, BufferConfig  # noqa: F401
from rlbus.common.reward_config import RewardConfig, RewardTerm  # noqa: F401
from rlbus.common.sections import (  # noqa: F401
    AlgorithmConfig, DataConfig, ExplorerConfig, Host, ModelConfig, RolloutConfig, Section, SyncConfig, TrainerConfig)


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says what to change."""


class RunSection(Section):
    name: str = "rlbus"
    """Run name, used in the run directory and the run id."""
    dir: str = "runs/default"
    """Run directory: config snapshot, logs, buffer, weights, checkpoints, metrics."""


class LoggingConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level written."""
    format: Literal["auto", "json", "console"] = "auto"
    """auto: readable on a terminal, JSON lines otherwise."""
    file: str = ""
    """Also append JSON lines to this file (empty: no file sink)."""


class MetricsConfig(Section):
    prometheus_port: int = Field(0, ge=0, le=65535)
    """Serve Prometheus `/metrics` on this port (0: off). `rlbus up` gives the broker this port, the trainer the
    next one and explorer i port + 2 + i."""
    prometheus_host: Host = "127.0.0.1"
    """Address the `/metrics` server binds (0.0.0.0 for a Prometheus on another host)."""
    tensorboard: bool = True
    """TensorBoard scalars of the trainer's steps and the explorers' evaluations, in RUN_DIR/tensorboard/."""
    wandb_project: str = ""
    """Also log the same scalars to this Weights & Biases project (needs `pip install wandb`; empty: off)."""


def _cpu_list(spec: str) -> str:
    try:
        parse_cpus(spec)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return spec


CpuList = Annotated[str, AfterValidator(_cpu_list)]


class LaunchConfig(Section):
    explorers: int = Field(1, ge=0)
    """Explorer processes `rlbus up` starts."""
    broker_cpus: CpuList = ""
    """Cores the broker is pinned to, e.g. "0" or "0-1" (empty: not pinned)."""
    trainer_cpus: CpuList = ""
    """Cores the trainer is pinned to."""
    explorer_cpus: list[CpuList] = []
    """Cores per explorer, in order (explorer i gets entry i; missing entries: not pinned)."""
    on_crash: Literal["stop", "restart"] = "stop"
    """When a component exits with an error: stop the run, or start it again."""
    max_restarts: int = Field(3, ge=0)
    """Restarts per component before the run is stopped anyway."""
    status_interval_s: float = Field(5.0, gt=0)
    """How often `rlbus up` prints a progress line."""
    start_together: bool = True
    """The trainer's first step waits for all `explorers` to join (trainer.wait_for_explorers), so that a slower
    engine start does not leave an explorer out of a short run."""


class RunConfig(Section):
    run: RunSection = RunSection()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    sync: SyncConfig = SyncConfig()
    buffer: BufferConfig = BufferConfig()
    broker: BrokerConfig = BrokerConfig()
    explorer: ExplorerConfig = ExplorerConfig()
    trainer: TrainerConfig = TrainerConfig()
    reward: RewardConfig = RewardConfig()
    logging: LoggingConfig = LoggingConfig()
    metrics: MetricsConfig = MetricsConfig()
    launch: LaunchConfig = LaunchConfig()

    @model_validator(mode="after")
    def _swap_lag(self) -> "RunConfig":
        lag, bound = self.explorer.swap_lag, self.sync.max_staleness
        if self.explorer.streaming and self.sync.sync_style == "async" and lag > bound:
            raise ValueError(f"explorer.swap_lag={lag} exceeds sync.max_staleness={bound}: a streaming explorer "
                             f"would hold weights whose samples are too stale to train on; set swap_lag <= {bound}")
        return self

    @model_validator(mode="after")
    def _can_learn(self) -> "RunConfig":
        a = self.algorithm
        if self.rollout.repeat < 2 and a.advantage != "reinforce_pp":
            raise ValueError(f"algorithm.advantage={a.advantage} compares the samples of a task with each other, and "
                             f"rollout.repeat={self.rollout.repeat} gives each task one: every advantage would be 0 "
                             f"and nothing would be learned; set rollout.repeat >= 2 (8 by default), or "
                             f"algorithm.advantage=reinforce_pp, which needs no groups")
        if a.is_mode == "mask" and not a.is_low <= 1 <= a.is_high:
            raise ValueError(f"algorithm.is_mode=mask keeps the tokens whose importance weight lies in [is_low, "
                             f"is_high] = [{a.is_low}, {a.is_high}], which leaves out 1, the weight of a token the "
                             f"policy sampled itself: on-policy samples would all be masked; set is_low <= 1 <= "
                             f"is_high")
        return self

    @model_validator(mode="after")
    def _room_for_a_batch(self) -> "RunConfig":
        need = self.data.batch_tasks * self.rollout.repeat
        if self.buffer.capacity < need:
            raise ValueError(f"buffer.capacity={self.buffer.capacity} cannot hold one batch (data.batch_tasks="
                             f"{self.data.batch_tasks} x rollout.repeat={self.rollout.repeat} = {need} trajectories): "
                             f"explorers would wait for room that never comes; set buffer.capacity >= {need}")
        return self

    def buffer_dir(self) -> Path:
        return Path(self.buffer.dir) if self.buffer.dir else Path(self.run.dir) / "buffer"

    def fetch_dir(self, explorer_name: str) -> Path:
        """Where an explorer keeps the versions it fetched."""
        return Path(self.explorer.weights_dir) if self.explorer.weights_dir else \
            Path(self.run.dir) / "fetched" / explorer_name.replace("/", "_")

    def bus_address(self) -> str:
        if self.broker.pub_address:
            return self.broker.pub_address
        base, _, _ = self.broker.address.rpartition(":")
        return f"{base}:{self.broker.pub_port}"


ENV_PREFIX = "RLBUS_"

# Keys that moved, and where to: a config that still uses one is told.
MOVED = {"explorer.temperature": "rollout.temperature", "explorer.top_p": "rollout.top_p",
         "explorer.max_tokens": "rollout.max_tokens", "explorer.dtype": "rollout.dtype",
         "data.repeat": "rollout.repeat", "trainer.seed": "rollout.seed"}


class _Loader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (which would silently keep the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` then a key of base's: an override, as YAML means it
            key = self.construct_object(key_node, deep=True)
            try:
                again = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the safe loader names it
                continue
            if again:
                raise yaml.constructor.ConstructorError("while reading a mapping", node.start_mark,
                                                        f"found {key!r} a second time", key_node.start_mark)
        return super().construct_mapping(node, deep)


def _parse_scalar(text: str) -> Any:
    """A command-line or environment value, read as YAML (so 1e-6, true, [1, 2] work).

    Only true/false are booleans: YAML 1.1 would also read on/off/yes/no so,
    which turns `buffer.fsync=off` into False. Only `{...}` is a mapping: YAML
    reads `::` (every interface, for a host) as one.
    """
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, bool) and text.strip().lower() not in ("true", "false"):
        return text.strip()
    if isinstance(value, dict) and not text.lstrip().startswith("{"):
        return text.strip()
    return value


def _set_dotted(tree: dict, dotted: str, value: Any, origin: str) -> None:
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(f"{origin}: empty key")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{origin}: {dotted} goes through {part!r}, which is not a section")
        node = child
    node[parts[-1]] = value


def _env_overrides(environ: dict[str, str]) -> list[tuple[str, Any, str]]:
    out = []
    for key, value in environ.items():
        if key.startswith(ENV_PREFIX) and "__" in key:
            dotted = key[len(ENV_PREFIX):].lower().replace("__", ".")
            out.append((dotted, _parse_scalar(value), f"environment {key}"))
        elif key.startswith(ENV_PREFIX) and (section := key[len(ENV_PREFIX):].partition("_")[0]).lower() \
                in RunConfig.model_fields:  # RLBUS_TRAINER_LR: a setting misspelt, never ignored
            field = key[len(ENV_PREFIX) + len(section) + 1:]
            raise ConfigError(f"environment {key}: a setting is RLBUS_SECTION__FIELD, two underscores after the "
                              f"section{f': {ENV_PREFIX}{section}__{field}?' if field else ''}")
    return out


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(root)"
        got = e.get("input")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown setting (check the spelling; `rlbus config show` lists every field)")
        elif isinstance(got, dict):
            lines.append(f"{where}: {msg}")
        else:
            lines.append(f"{where} = {got!r:.60}: {msg}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def load_config(path: str | Path | None = None, sets: list[str] | None = None,
                environ: dict[str, str] | None = None) -> RunConfig:
    """Load a RunConfig from YAML, environment and `key=value` overrides."""
    tree: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} {'is a directory' if p.is_dir() else 'does not exist'}")
        try:
            text = io.StringIO(p.read_text(encoding="utf-8"))
            text.name = str(p)  # for the line an error names
            loaded = yaml.load(text, _Loader) or {}
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {p} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except (yaml.YAMLError, OSError) as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(loaded).__name__}")
        tree = loaded
    for dotted, value, origin in _env_overrides(dict(os.environ if environ is None else environ)):
        _set_dotted(tree, dotted, value, origin)
    for item in sets or []:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set trainer.lr=1e-6")
        _set_dotted(tree, key.strip(), _parse_scalar(text), f"--set {item}")
    for old, new in MOVED.items():
        section, _, field = old.partition(".")
        if isinstance(tree.get(section), dict) and field in tree[section]:
            raise ConfigError(f"{old} is now {new}: the settings every process of a run must agree on live in "
                              f"the rollout section")
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None


def parse_cpus(spec: str) -> set[int]:
    """ "0", "0-1", "0,2-3" -> a set of core numbers; raises ConfigError for anything else."""
    cores: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, _, hi = part.partition("-")
        if not lo.isascii() or not lo.isdigit() or (hi and not (hi.isascii() and hi.isdigit())) \
                or int(hi or lo) < int(lo):
            raise ConfigError(f"cpu list {spec!r}: use core numbers and ranges like 0,2-3")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def writable_dirs(cfg: RunConfig, component: str) -> None:
    """Create the directories `component` writes to, and open its log file; ConfigError naming the setting of one
    it cannot write to (a path under a file, a read-only place), before anything starts."""
    dirs = {"broker": {"buffer.dir" if cfg.buffer.dir else "run.dir": cfg.buffer_dir()},
            "up": {"run.dir": Path(cfg.run.dir)}, "trainer": {"run.dir": Path(cfg.run.dir)}}.get(component, {})
    if cfg.logging.file:
        dirs["logging.file"] = Path(cfg.logging.file).parent
    for setting, path in dirs.items():
        try:
            path.mkdir(parents=True, exist_ok=True)
            if not os.access(path, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
            if setting == "logging.file":
                path = Path(cfg.logging.file)
                open(path, "a").close()
        except OSError as exc:
            raise ConfigError(f"{setting}: cannot write to {str(path)!r} ({exc.strerror})") from None

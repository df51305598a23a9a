"""The reward plugin interface.

A reward is a callable `score(task, response) -> RewardResult | float`:

- `task`: the task map the broker leased (`prompt`, `answer`, and whatever
  fields its taskset adds);
- `response`: a `Response` with the text and token ids the model produced;
- the result: a score and details; a score of zero should say why in
  `reason`.

Rewards are found by registered name (`arith`, ...) or by dotted path
(`mypkg.rewards:score`). `evaluate` wraps every call: an exception or a score
that is not a finite number (NaN, infinite, or no number at all) is logged
with its reason and scored `failure_score` (default 0): never a crash, never
a silent drop.
"""

from __future__ import annotations

import importlib
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import structlog

from rlbus.common.config import ConfigError
from rlbus.common.protocol import brief

log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class Response:
    text: str
    """The model's (last) reply."""
    token_ids: Sequence[int] = ()
    """Token ids of everything the model produced (all turns)."""
    turns: Sequence[str] = ()
    """Multi-turn episodes: each of the model's replies in order (text is the last)."""


@dataclass(slots=True)
class RewardResult:
    score: float
    details: dict[str, Any] = field(default_factory=dict)
    reason: str = ""


RewardFn = Callable[[Mapping[str, Any], Response], "RewardResult | float"]
REGISTRY: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make a reward available by `name` in configs."""

    def add(fn: RewardFn) -> RewardFn:
        REGISTRY[name] = fn
        return fn

    return add


def resolve(spec: str) -> RewardFn:
    """A reward by registered name or `module.path:function`; `auto` picks by each task's `kind`."""
    _load_builtins()
    if spec == "auto":
        return _by_kind
    if spec in REGISTRY:
        return REGISTRY[spec]
    module, sep, attr = spec.partition(":")
    if not sep:
        raise ConfigError(f"unknown reward {spec!r}: registered ones are {sorted(REGISTRY)}, "
                          f"or give a dotted path like mypkg.rewards:score")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"reward {spec!r} cannot be loaded: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"reward {spec!r} is not callable")
    return fn


def evaluate(fn: RewardFn, task: Mapping[str, Any], response: Response, failure_score: float = 0.0,
             name: str = "") -> RewardResult:
    """Call a reward safely: exceptions and non-finite scores become `failure_score` with a reason, and the
    details become what a trajectory can carry (`plain`)."""
    try:
        result = fn(task, response)
    except Exception as exc:  # a plugin's bug must not stop rollouts
        log.warning("reward_failed", reward=name, task_id=task.get("task_id"), error=repr(exc)[:300])
        return RewardResult(failure_score, {"error": repr(exc)[:300]}, "reward raised an exception")
    if not isinstance(result, RewardResult):
        result = RewardResult(result)
    details = plain(result.details) if isinstance(result.details, Mapping) else {"details": plain(result.details)}
    score = as_number(result.score)
    if score is None or not math.isfinite(score):
        log.warning("reward_not_finite", reward=name, task_id=task.get("task_id"), score=repr(result.score)[:300])
        return RewardResult(failure_score, {**details, "raw_score": repr(result.score)[:300]},
                            "reward was not a finite number")
    return RewardResult(score, details, str(result.reason or ""))


def as_number(value: Any) -> float | None:
    """A score as a float (a Python or numpy number, a one-element tensor), or None when it is none: a string
    is none either, though float() would read one."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: torch's, for a tensor of several elements
        return None


MAX_DETAILS_DEPTH = 8


def plain(value: Any, depth: int = 0) -> Any:
    """`value` as a trajectory's payload can carry it (msgpack) and a JSON reader can show it: None, bools,
    strings, floats, integers of 64 bits, and lists and maps of them, MAX_DETAILS_DEPTH deep. Anything else (a
    larger integer, bytes, a set, an object, deeper nesting) becomes its repr, bounded in depth and length: a
    reward's details never stop a rollout."""
    if value is None or isinstance(value, (bool, str, float)):
        return value
    if isinstance(value, numbers.Integral) and -(1 << 63) <= value < (1 << 64):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return float(value)
    if depth < MAX_DETAILS_DEPTH and isinstance(value, (list, tuple)):
        return [plain(v, depth + 1) for v in value]
    if depth < MAX_DETAILS_DEPTH and isinstance(value, Mapping):
        return {k if isinstance(k, str) else _brief(k): plain(v, depth + 1) for k, v in value.items()}
    return _brief(value)


def _brief(value: Any) -> str:
    """A bounded repr (`brief`: depth and length cut); an integer past Python's 4,300 digits has none at all."""
    try:
        return brief(value)
    except ValueError:
        return f"<{type(value).__name__} of {value.bit_length() if isinstance(value, int) else '?'} bits>"


def _by_kind(task: Mapping[str, Any], response: Response) -> RewardResult | float:
    kind = task.get("kind")
    if kind not in REGISTRY:
        raise ValueError(f"task kind {kind!r} has no registered reward; set reward.fn")
    return REGISTRY[kind](task, response)


def combine(terms: Sequence[tuple[str, float, Mapping[str, Any]]]) -> RewardFn:
    """A weighted sum of rewards, each with its own parameters; details keep every term's result."""
    import functools

    parts = [(name, weight, functools.partial(_with_params(name, params), **dict(params)))
             for name, weight, params in terms]

    def combined(task: Mapping[str, Any], response: Response) -> RewardResult:
        total, details, reasons = 0.0, {}, []
        for name, weight, fn in parts:
            r = evaluate(fn, task, response, name=name)
            total += weight * r.score
            details[name] = {"score": r.score, "weight": weight, **({"reason": r.reason} if r.reason else {})}
            if r.reason:
                reasons.append(f"{name}: {r.reason}")
        return RewardResult(total, details, "; ".join(reasons) if total == 0 else "")

    return combined


def _with_params(name: str, params: Mapping[str, Any]) -> RewardFn:
    """The reward `name`, once it is known to take `params` (a misspelt one would fail every call, each
    sample scoring the failure score, and the run would train on nothing)."""
    import inspect

    fn = resolve(name)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without a signature: taken on trust
        return fn
    try:
        signature.bind_partial(None, None, **dict(params))
    except TypeError:
        takes = list(signature.parameters)[2:]
        raise ConfigError(f"reward term {name!r}: parameters {sorted(params)} do not fit it; it takes "
                          f"{', '.join(takes) or 'none'}") from None
    return fn


def from_config(cfg) -> RewardFn:
    """The reward a `RewardConfig` describes, wrapped so failures score `failure_score`."""
    from rlbus.reward import code
    from rlbus.reward.sandbox import Limits

    code.configure(Limits(cfg.sandbox_cpu_s, cfg.sandbox_memory_mb, cfg.sandbox_file_mb, cfg.sandbox_processes,
                          wall_s=cfg.sandbox_wall_s), python=cfg.sandbox_python)
    terms = [(t.fn, t.params) for t in cfg.terms] or [(cfg.fn, {})]
    if not cfg.service and any(spec == "rm" and not params.get("path") for spec, params in terms):
        # Else every sample would score 0 (a reward worker's rm service scores with a model of its own).
        raise ConfigError("the rm reward needs its model: reward.terms: [{fn: rm, weight: 1.0, params: {path: "
                          "DIR}}] (a sequence-classification model directory), or a reward worker's rm service")
    if cfg.terms:
        fn, name = combine([(t.fn, t.weight, t.params) for t in cfg.terms]), "combined"
    else:
        fn, name = resolve(cfg.fn), cfg.fn
    return lambda task, response: evaluate(fn, task, response, cfg.failure_score, name)


def check_kinds(cfg, tasks: Iterable[Mapping[str, Any]], setting: str) -> None:
    """With `reward.fn: auto` (each task scored by the reward its `kind` names), ConfigError unless every task's
    kind names one: otherwise each of their samples would score the failure score, and the run train on nothing.
    Tasks scored by reward workers (`reward.service`) are theirs to score."""
    if cfg.terms or cfg.fn != "auto" or cfg.service:
        return
    _load_builtins()
    unknown = {t.get("kind") for t in tasks} - REGISTRY.keys()
    if unknown:
        raise ConfigError(f"reward.fn: auto scores each task by the reward its kind names, and tasks of {setting} "
                          f"have kind {', '.join(sorted(map(repr, unknown)))}: set reward.fn (e.g. math or exact) "
                          f"or give each row a kind of {sorted(REGISTRY)}")


def _load_builtins() -> None:
    from rlbus.reward import arith, code, countdown, guess, math, rm, text  # noqa: F401  (they register themselves)

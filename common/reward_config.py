"""The reward section of a run's configuration (`config.py` assembles it with the others, from `sections.py`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rlbus.common.sections import Section


class RewardTerm(Section):
    fn: str
    """A registered reward or a dotted path."""
    weight: float = 1.0
    """Its weight in the sum."""
    params: dict[str, Any] = {}
    """Keyword arguments for it (e.g. format: {tags: [think, answer]})."""


class RewardConfig(Section):
    fn: str = "auto"
    """Reward by registered name or dotted path (`mypkg.rewards:score`); auto: the one named by each task's kind."""
    terms: list[RewardTerm] = []
    """A weighted sum of rewards instead of `fn` (e.g. math 1.0 + format 0.1)."""
    failure_score: float = 0.0
    """Score given when a reward raises or returns NaN or infinity (logged with the reason)."""
    service: str = ""
    """Score through reward workers offering this service, via the broker, instead of in-process."""
    services: list[str] = ["math", "code"]
    """`rlbus reward`: services this worker offers (registered rewards, dotted paths, or rm)."""
    rm_path: str = ""
    """`rlbus reward`: the sequence-classification model the rm service scores with."""
    eval_timeout_s: float = Field(60.0, gt=0)
    """How long one evaluation may take at a reward worker before it is sent to another."""
    eval_attempts: int = Field(3, ge=1)
    """Workers tried per evaluation before it fails."""
    sandbox_cpu_s: int = Field(2, ge=1)
    """Code sandbox: CPU seconds per test."""
    sandbox_wall_s: float = Field(5.0, gt=0)
    """Code sandbox: wall-clock seconds per test."""
    sandbox_memory_mb: int = Field(512, ge=32)
    """Code sandbox: address space."""
    sandbox_file_mb: int = Field(4, ge=1)
    """Code sandbox: largest file, stdout and stderr included."""
    sandbox_processes: int = Field(16, ge=1)
    """Code sandbox: processes (counted for the sandbox user)."""
    sandbox_python: str = ""
    """Code sandbox: interpreter (default: this one, or the system python3 if the sandbox user cannot run it)."""

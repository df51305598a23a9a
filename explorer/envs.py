"""Environments that answer between the model's turns, for multi-turn workflows.

An environment is made per episode from the task (`make_env(task)`), and
`step(reply_text)` returns what it says back and whether the episode is over.
The workflow puts the environment's words into the conversation with the
chat template, and masks them out of the loss: only the model's own tokens
are trained on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

_INT = re.compile(r"-?\d+")
_DIGITS = 100  # a longer run of digits is no guess of a number in range (and past 4,300, int() refuses it)


@dataclass
class GuessNumber:
    """The model guesses a secret integer; the environment says higher, lower or correct."""

    secret: int
    low: int
    high: int
    max_turns: int
    turns: int = 0
    solved: bool = False

    def step(self, reply: str) -> tuple[str, bool]:
        self.turns += 1
        numbers = _INT.findall(reply)
        if not numbers or len(numbers[-1]) > _DIGITS:
            message = f"Please answer with a single number between {self.low} and {self.high}."
        else:
            guess = int(numbers[-1])
            if guess == self.secret:
                self.solved = True
                return "Correct!", True
            message = "Higher." if guess < self.secret else "Lower."
        return message, self.turns >= self.max_turns


def make_env(task: Mapping[str, Any]):
    """The environment a task names in `env`, or None for single-turn tasks."""
    kind = task.get("env")
    if kind is None:
        return None
    if kind == "guess":
        return GuessNumber(int(task["answer"]), int(task["low"]), int(task["high"]), int(task["max_turns"]))
    raise ValueError(f"task {task.get('task_id')!r} names unknown environment {kind!r}")

"""Guess the number (a multi-turn task): 1.0 if the model's last reply names the secret."""

from __future__ import annotations

import re
from typing import Any, Mapping

from rlbus.reward.base import Response, RewardResult, register

_INT = re.compile(r"-?\d+")


@register("guess")
def guessed(task: Mapping[str, Any], response: Response) -> RewardResult:
    turns = list(response.turns) or [response.text]
    numbers = _INT.findall(turns[-1])
    if numbers and int(numbers[-1]) == int(task["answer"]):
        return RewardResult(1.0, {"turns": len(turns)})
    return RewardResult(0.0, {"turns": len(turns)}, f"not guessed in {len(turns)} turns")

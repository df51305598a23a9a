"""Arithmetic answers: 1.0 when the last integer in the response equals the task's answer.

The default task (DESIGN.md §6) restates the question before answering, so the
*last* integer is the answer; the first would reward nothing.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from rlbus.reward.base import Response, RewardResult, register

_INT = re.compile(r"-?\d+")


@register("arith")
def last_integer_matches(task: Mapping[str, Any], response: Response) -> RewardResult:
    numbers = _INT.findall(response.text.replace(",", ""))
    if not numbers:
        return RewardResult(0.0, {"extracted": None}, "no integer in the response")
    got = numbers[-1]
    if int(got) == int(task["answer"]):
        return RewardResult(1.0, {"extracted": got})
    return RewardResult(0.0, {"extracted": got}, f"last integer {got} is not {task['answer']}")

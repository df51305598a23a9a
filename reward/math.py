"""Math answers checked with `math-verify`: the boxed answer if there is one, else the last number.

The reference answer (`task["answer"]`) and the extracted prediction are both
parsed by math-verify and compared symbolically, so 42, 42.0, \\frac{84}{2}
and \\boxed{42} all count. math-verify bounds its own parsing time with
signals, so call it from a main thread (the explorer and reward workers do).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from rlbus.reward.base import Response, RewardResult, register

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


@register("math")
def math_answer(task: Mapping[str, Any], response: Response) -> RewardResult:
    from math_verify import parse, verify

    boxed = _boxed(response.text)
    if boxed is not None:
        candidate, how = f"${boxed}$", "boxed"
    else:
        numbers = _NUMBER.findall(response.text.replace(",", ""))
        if not numbers:
            return RewardResult(0.0, {"extracted": None}, "no boxed answer and no number in the response")
        candidate, how = numbers[-1], "last_number"
    gold, pred = parse(f"${task['answer']}$"), parse(candidate)
    if not pred:
        return RewardResult(0.0, {"extracted": candidate, "how": how}, "answer could not be parsed")
    if verify(gold, pred):
        return RewardResult(1.0, {"extracted": candidate, "how": how})
    return RewardResult(0.0, {"extracted": candidate, "how": how}, f"{candidate} is not {task['answer']}")

"""Countdown: the equation uses the given numbers once each and evaluates to the target.

The equation is parsed with `ast` and evaluated over + - * / on integer
literals only; nothing from the response is ever executed.
"""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from typing import Any, Mapping

from rlbus.reward.base import Response, RewardResult, register

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_EQUATION = re.compile(r"[\d\s()+\-*/.]+")


def _evaluate(node: ast.AST, used: list[int]) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left, used), _evaluate(node.right, used))
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        used.append(node.value)
        return node.value
    raise ValueError(f"{type(node).__name__} is not allowed")


@register("countdown")
def countdown(task: Mapping[str, Any], response: Response) -> RewardResult:
    text = response.text.split("=")[0] if "=" in response.text else response.text
    candidates = [c.strip() for c in _EQUATION.findall(text) if any(ch.isdigit() for ch in c)]
    if not candidates:
        return RewardResult(0.0, {"equation": None}, "no equation in the response")
    equation = max(candidates, key=len)
    used: list[int] = []
    try:
        value = _evaluate(ast.parse(equation, mode="eval"), used)
        off = abs(value - float(task["target"]))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, OverflowError) as exc:
        # OverflowError: long literals whose product or quotient no float holds ("10000000000 ** 40" written out)
        return RewardResult(0.0, {"equation": equation}, f"equation does not evaluate: {exc}")
    details = {"equation": equation, "value": value}
    if Counter(used) != Counter(int(n) for n in task["numbers"]):
        return RewardResult(0.0, details, f"uses {sorted(used)}, not each of {sorted(task['numbers'])} once")
    if off > 1e-6:
        return RewardResult(0.0, details, f"equals {value}, not {task['target']}")
    return RewardResult(1.0, details)

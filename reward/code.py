"""Code: the fraction of the task's tests the response's program passes in the sandbox.

The program is the last ```python fenced block of the response (or the whole
response without fences). `task["tests"]` holds assert snippets or
`{"input", "output"}` pairs (reward/sandbox.py).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from rlbus.reward.base import Response, RewardResult, register
from rlbus.reward.sandbox import Limits, Sandbox

_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
_sandbox: Sandbox | None = None


def configure(limits: Limits, python: str = "") -> None:
    """Set the limits every later `code` reward runs under."""
    global _sandbox
    _sandbox = Sandbox(limits, python=python)


def extract_program(text: str) -> str:
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


@register("code")
def code_tests(task: Mapping[str, Any], response: Response) -> RewardResult:
    global _sandbox
    tests = task.get("tests") or []
    if not tests:
        return RewardResult(0.0, {}, "the task has no tests")
    program = extract_program(response.text)
    if not program.strip():
        return RewardResult(0.0, {}, "no program in the response")
    if _sandbox is None:
        _sandbox = Sandbox()
    result = _sandbox.run_tests(program, list(tests))
    details = {"passed": sum(t.passed for t in result.tests), "total": len(result.tests),
               "reasons": [t.reason for t in result.tests]}
    return RewardResult(result.score, details, result.reason if result.score < 1 else "")

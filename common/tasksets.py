"""Tasksets: where the broker's tasks come from.

A taskset maps a task sequence number to a task (a msgpack-able map with at
least `task_id` and `prompt`), deterministically, so the broker only has to
remember how far it got, and a restarted broker re-issues exactly the same
tasks. Generated tasksets are endless unless `data.max_tasks` bounds them.
"""

from __future__ import annotations

import random
from typing import Any, Protocol

from common.config import DataConfig

ARITH_PROMPT = "What is {a} + {b}? Answer with just the number."


class Taskset(Protocol):
    def __len__(self) -> int: ...  # 0 means endless
    def task(self, seq: int) -> dict[str, Any]: ...


class ArithTaskset:
    """a + b with a, b uniform integers in [0, max_operand]; the answer is the sum."""

    def __init__(self, seed: int = 0, max_operand: int = 20, size: int = 0):
        self.seed = seed
        self.max_operand = max_operand
        self.size = size

    def __len__(self) -> int:
        return self.size

    def task(self, seq: int) -> dict[str, Any]:
        rng = random.Random(f"arith:{self.seed}:{seq}")
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return {"task_id": f"arith-{self.seed}-{seq}", "prompt": ARITH_PROMPT.format(a=a, b=b),
                "answer": str(a + b), "kind": "arith"}


def make_taskset(data: DataConfig, eval_set: bool = False) -> Taskset:
    """The training taskset the config names, or its held-out evaluation set."""
    if eval_set:
        return ArithTaskset(data.eval_seed, data.max_operand, data.eval_size)
    return ArithTaskset(data.seed, data.max_operand, data.max_tasks)

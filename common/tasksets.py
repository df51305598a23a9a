"""Tasksets: where the broker's tasks come from.

A taskset maps a task sequence number to a task (a msgpack-able map with at
least `task_id`, `prompt` and `kind`), deterministically, so the broker only
has to remember how far it got, and a restarted broker re-issues exactly the
same tasks. Generated tasksets are endless unless `data.max_tasks` bounds
them; file tasksets hold their rows `data.epochs` times over.

`kind` names the reward that scores the task when `reward.fn` is `auto`;
`env`, when present, names the environment a multi-turn workflow plays.
"""

from __future__ import annotations

import json
import operator
import random
from pathlib import Path
from typing import Any, Protocol

from rlbus.common.config import ConfigError, DataConfig

ARITH_PROMPT = "What is {a} + {b}? Answer with just the number."
GUESS_PROMPT = ("I am thinking of an integer between {low} and {high}. Guess it; after each guess I will say "
                "higher or lower. Answer with just the number.")
COUNTDOWN_PROMPT = ("Using the numbers {numbers}, write an equation that equals {target}. Use each number exactly "
                    "once, with + - * / and parentheses. Answer with just the equation.")


class Taskset(Protocol):
    def __len__(self) -> int: ...  # 0 means endless
    def task(self, seq: int) -> dict[str, Any]: ...


class ArithTaskset:
    """a + b with a, b uniform integers in [0, max_operand]; the answer is the sum."""

    def __init__(self, seed: int = 0, max_operand: int = 20, size: int = 0):
        self.seed, self.max_operand, self.size = seed, max_operand, size

    def __len__(self) -> int:
        return self.size

    def task(self, seq: int) -> dict[str, Any]:
        rng = random.Random(f"arith:{self.seed}:{seq}")
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return {"task_id": f"arith-{self.seed}-{seq}", "prompt": ARITH_PROMPT.format(a=a, b=b),
                "answer": str(a + b), "kind": "arith"}


class GuessTaskset:
    """Guess a secret integer in [1, max_operand] within `max_turns` turns (multi-turn)."""

    def __init__(self, seed: int = 0, high: int = 20, max_turns: int = 5, size: int = 0):
        self.seed, self.high, self.max_turns, self.size = seed, high, max_turns, size

    def __len__(self) -> int:
        return self.size

    def task(self, seq: int) -> dict[str, Any]:
        secret = random.Random(f"guess:{self.seed}:{seq}").randint(1, self.high)
        return {"task_id": f"guess-{self.seed}-{seq}", "prompt": GUESS_PROMPT.format(low=1, high=self.high),
                "answer": str(secret), "low": 1, "high": self.high, "max_turns": self.max_turns,
                "kind": "guess", "env": "guess"}


_OPS = [("+", operator.add), ("-", operator.sub), ("*", operator.mul)]


class CountdownTaskset:
    """Reach a target from 3 or 4 numbers, each used once; every task is solvable by construction."""

    def __init__(self, seed: int = 0, max_operand: int = 20, size: int = 0):
        self.seed, self.max_operand, self.size = seed, max_operand, size

    def __len__(self) -> int:
        return self.size

    def task(self, seq: int) -> dict[str, Any]:
        rng = random.Random(f"countdown:{self.seed}:{seq}")
        while True:
            numbers = [rng.randint(1, self.max_operand) for _ in range(rng.choice((3, 4)))]
            value = numbers[0]
            for n in numbers[1:]:
                _, op = rng.choice(_OPS)
                value = op(value, n)
            if 0 < value <= 1000:
                break
        shown = sorted(numbers)
        return {"task_id": f"countdown-{self.seed}-{seq}",
                "prompt": COUNTDOWN_PROMPT.format(numbers=", ".join(map(str, shown)), target=value),
                "answer": str(value), "numbers": shown, "target": value, "kind": "countdown"}


class FileTaskset:
    """Rows of a jsonl or parquet file, or a saved HF `datasets` directory."""

    def __init__(self, path: str, prompt_field: str, answer_field: str, epochs: int = 1, kind: str = "file"):
        self.path = Path(path)
        self.rows = _read_rows(self.path)
        if not self.rows:
            raise ValueError(f"taskset file {path} has no rows")
        for i, row in enumerate(self.rows):  # every row: a task that cannot be made would fail its LEASE mid-run
            if not isinstance(row, dict):
                raise ValueError(f"taskset file {path}: row {i + 1} is a JSON {type(row).__name__}, not an object")
            for field in (prompt_field, answer_field):
                if field not in row:
                    raise ValueError(f"taskset file {path}: row {i + 1} has no field {field!r}; its fields are "
                                     f"{sorted(row)} (set data.prompt_field / data.answer_field)")
                if row[field] is None:  # it would be trained on as the text "None"
                    raise ValueError(f"taskset file {path}: row {i + 1} has no value for {field!r} (null)")
            if not isinstance(row.get("kind", ""), str):
                raise ValueError(f"taskset file {path}: row {i + 1}: its kind is a {type(row['kind']).__name__}, "
                                 "not the name of a reward")
        self.prompt_field, self.answer_field, self.epochs, self.kind = prompt_field, answer_field, epochs, kind

    def __len__(self) -> int:
        return len(self.rows) * self.epochs

    def task(self, seq: int) -> dict[str, Any]:
        row = self.rows[seq % len(self.rows)]
        extra = {k: v for k, v in row.items() if k not in (self.prompt_field, self.answer_field)
                 and isinstance(v, (str, int, float, bool, type(None)))}
        return {**extra, "task_id": f"{self.path.stem}-{seq}", "prompt": str(row[self.prompt_field]),
                "answer": str(row[self.answer_field]), "kind": row.get("kind") or self.kind,
                "row": seq % len(self.rows)}


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise FileNotFoundError(f"taskset file {path} does not exist")
    if path.is_dir():
        from datasets import load_from_disk  # saved with Dataset.save_to_disk

        data = load_from_disk(str(path))
        if hasattr(data, "keys"):  # a DatasetDict: take the train split, or the only one
            data = data["train"] if "train" in data else data[next(iter(data))]
        return [dict(r) for r in data]
    if path.suffix == ".jsonl":
        rows = []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{i}: not JSON: {exc}") from None
        return rows
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"taskset file {path}: use .jsonl, .parquet, or a saved HF datasets directory")


def make_taskset(data: DataConfig, eval_set: bool = False) -> Taskset | None:
    """The training taskset the config names, or its held-out evaluation set (None for a file taskset without
    `data.eval_path`: no held-out set, rather than every training row)."""
    seed, size = (data.eval_seed, data.eval_size) if eval_set else (data.seed, data.max_tasks)
    if data.taskset == "arith":
        return ArithTaskset(seed, data.max_operand, size)
    if data.taskset == "guess":
        return GuessTaskset(seed, data.max_operand, data.max_turns, size)
    if data.taskset == "countdown":
        return CountdownTaskset(seed, data.max_operand, size)
    if eval_set and not data.eval_path:
        return None
    setting = "data.eval_path" if eval_set else "data.path"
    try:
        return FileTaskset(getattr(data, setting[5:]), data.prompt_field, data.answer_field,
                           1 if eval_set else data.epochs)
    except (OSError, ValueError) as exc:  # a file missing or unreadable, a row without its fields
        raise ConfigError(f"{setting}: {exc}") from None

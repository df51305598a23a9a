"""Every registered reward honours the contract on valid and malformed responses."""

from __future__ import annotations

import math

import pytest

from common.tasksets import ArithTaskset, CountdownTaskset, GuessTaskset
from reward.base import REGISTRY, Response, RewardResult, _load_builtins, evaluate, resolve

_load_builtins()
TASKS = {"arith": ArithTaskset(0).task(0), "countdown": CountdownTaskset(0).task(0), "guess": GuessTaskset(0).task(0)}
MALFORMED = ["", " ", "\x00\xff", "9" * 5000, "((((((", "<|im_end|>", "NaN", "1/0", "🙂" * 100]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_reward_contract(name):
    fn = REGISTRY[name]
    task = TASKS[name]
    right = Response(task["answer"]) if name != "countdown" else None
    if right is not None:
        assert evaluate(fn, task, right).score == 1.0
    for text in MALFORMED:
        result = evaluate(fn, task, Response(text, (1, 2)))
        assert isinstance(result, RewardResult) and math.isfinite(result.score)
        if result.score == 0.0:
            assert result.reason, f"{name} scored {text!r:.20} zero without a reason"


def test_exceptions_and_non_finite_scores_become_the_failure_score():
    def broken(task, response):
        raise KeyError("boom")

    r = evaluate(broken, {"task_id": "x"}, Response("a"), failure_score=-1.0)
    assert r.score == -1.0 and "exception" in r.reason
    r = evaluate(lambda t, resp: float("nan"), {"task_id": "x"}, Response("a"))
    assert r.score == 0.0 and "finite" in r.reason
    assert evaluate(lambda t, resp: 0.5, {}, Response("a")).score == 0.5


def test_rewards_by_dotted_path_and_clear_errors():
    assert resolve("reward.arith:last_integer_matches") is REGISTRY["arith"]
    with pytest.raises(ValueError, match="registered ones are"):
        resolve("nonesuch")
    with pytest.raises(ValueError, match="cannot be loaded"):
        resolve("nowhere.module:fn")

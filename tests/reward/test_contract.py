"""Every registered reward honours the contract on valid and malformed responses."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlbus.common.protocol import pack, unpack
from rlbus.common.tasksets import ArithTaskset, CountdownTaskset, GuessTaskset
from rlbus.reward.base import REGISTRY, Response, RewardResult, _load_builtins, evaluate, plain, resolve

_load_builtins()
TASKS = {"arith": ArithTaskset(0).task(0), "countdown": CountdownTaskset(0).task(0), "guess": GuessTaskset(0).task(0),
         "math": {"answer": "\\frac{1}{2}"}, "exact": {"answer": "Paris"}, "format": {"answer": ""},
         "length_penalty": {"answer": ""}, "code": {"tests": ["assert f(2) == 4"]}, "rm": {"prompt": "x"}}
RIGHT = {"math": "so the answer is \\boxed{0.5}", "format": "<think>a</think> <answer>b</answer>",
         "length_penalty": "short", "code": "```python\ndef f(x):\n    return 2 * x\n```", "countdown": None, "rm": None}
MALFORMED = ["", " ", "\x00\xff", "9" * 5000, "((((((", "<|im_end|>", "NaN", "1/0", "🙂" * 100,
             "12345678901234567890 * 98765432109876543210", "1" * 400 + " / 3"]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_reward_contract(name):
    fn = REGISTRY[name]
    task = TASKS[name]
    right = RIGHT.get(name, task.get("answer"))
    if right is not None:
        expected = 0.0 if name == "length_penalty" else 1.0
        assert evaluate(fn, task, Response(right)).score == expected
    for text in MALFORMED:
        result = evaluate(fn, task, Response(text, (1, 2)))
        assert isinstance(result, RewardResult) and math.isfinite(result.score)
        pack(result.details)  # a trajectory carries them
        if result.score == 0.0:
            assert result.reason, f"{name} scored {text!r:.20} zero without a reason"


def test_details_a_trajectory_cannot_carry_become_their_repr():
    """A countdown product past 64 bits stopped a streaming explorer (msgpack refused it); any reward's details
    now arrive as msgpack carries them."""
    np = pytest.importorskip("numpy")
    deep: dict = {"x": 1}
    for _ in range(20):
        deep = {"d": deep}
    details = {"big": 1 << 70, "small": -(1 << 63), "set": {1}, "f32": np.float32(0.5), "i64": np.int64(3),
               "nested": [1, (2, "a")], 7: "key", "deep": deep, "nan": float("nan"), "raw": b"\x00"}
    r = evaluate(lambda t, resp: RewardResult(1.0, details), {}, Response("a"))
    got = unpack(pack(r.details))
    assert got["big"] == str(1 << 70) and got["small"] == -(1 << 63) and got["set"] == "{1}"
    assert got["f32"] == 0.5 and got["i64"] == 3 and got["nested"] == [1, [2, "a"]] and got["7"] == "key"
    assert math.isnan(got["nan"]) and "'d'" in str(got["deep"]) and got["raw"] == "b'\\x00'"
    assert evaluate(lambda t, resp: RewardResult(0.0, ["not", "a map"], "why"), {}, Response("a")).details == {
        "details": ["not", "a map"]}
    assert plain(object()).startswith("<object object")
    assert plain(10 ** 5000) == "<int of 16610 bits>"  # Python gives such an integer no repr
    cd = evaluate(REGISTRY["countdown"], TASKS["countdown"], Response("12345678901234567890 * 98765432109876543210"))
    assert cd.score == 0.0 and cd.details["value"] == str(12345678901234567890 * 98765432109876543210)


def test_exceptions_and_non_finite_scores_become_the_failure_score():
    def broken(task, response):
        raise KeyError("boom")

    r = evaluate(broken, {"task_id": "x"}, Response("a"), failure_score=-1.0)
    assert r.score == -1.0 and "exception" in r.reason
    r = evaluate(lambda t, resp: float("nan"), {"task_id": "x"}, Response("a"))
    assert r.score == 0.0 and "finite" in r.reason
    assert evaluate(lambda t, resp: 0.5, {}, Response("a")).score == 0.5


@pytest.mark.parametrize("given", ["0.5", b"1", None, [1.0], {"score": 1.0}, object(), np.array([1.0, 2.0]),
                                   torch.tensor([1.0, 0.0]), np.float32("nan")])
def test_a_score_that_is_no_finite_number_becomes_the_failure_score_bare_or_in_a_result(given):
    for fn in (lambda t, resp: given, lambda t, resp: RewardResult(given, {}, "")):
        r = evaluate(fn, {"task_id": "x"}, Response("a"), failure_score=-1.0)
        assert (r.score, r.reason) == (-1.0, "reward was not a finite number") and "raw_score" in r.details


@pytest.mark.parametrize("given", [np.float32(0.25), np.float64(0.25), np.int64(1), torch.tensor(0.25), True])
def test_a_numpy_or_torch_number_is_a_score_bare_or_in_a_result(given):
    for fn in (lambda t, resp: given, lambda t, resp: RewardResult(given, {}, "why")):
        r = evaluate(fn, {}, Response("a"))
        assert r.score == float(given) and type(r.score) is float


def test_weighted_combination_and_parameters():
    from rlbus.reward.base import combine

    fn = combine([("math", 1.0, {}), ("format", 0.5, {"pattern": r"\\boxed\{.*\}"})])
    r = fn({"answer": "3"}, Response("\\boxed{3}"))
    assert r.score == 1.5 and r.details["format"]["score"] == 1.0
    r = fn({"answer": "3"}, Response("it is 4"))
    assert r.score == 0.0 and "math:" in r.reason and "format:" in r.reason


def test_math_extraction_prefers_boxed_then_last_number():
    fn = REGISTRY["math"]
    assert fn({"answer": "42"}, Response("7 * 6 = \\boxed{42}, not 41")).details["how"] == "boxed"
    assert fn({"answer": "42"}, Response("first 3, then 42")).score == 1.0
    assert fn({"answer": "42"}, Response("first 42, then 3")).score == 0.0


def test_rewards_by_dotted_path_and_clear_errors():
    assert resolve("rlbus.reward.arith:last_integer_matches") is REGISTRY["arith"]
    with pytest.raises(ValueError, match="registered ones are"):
        resolve("nonesuch")
    with pytest.raises(ValueError, match="cannot be loaded"):
        resolve("nowhere.module:fn")


def test_format_tags_are_names_not_patterns():
    fn = REGISTRY["format"]
    assert fn({}, Response("<c++>x</c++>"), tags=("c++",)).score == 1.0  # a pattern, it raised re.error
    assert fn({}, Response("<a.b>x</a.b>"), tags=("a.b",)).score == 1.0
    assert fn({}, Response("<axb>x</axb>"), tags=("a.b",)).score == 0.0  # as a pattern, "." matched "x"
    assert fn({}, Response("<answer>4</answer>"), tags="answer").score == 1.0  # one tag given as a string
    assert fn({}, Response("<a>4</a>"), tags="answer").score == 0.0


def test_a_reward_term_with_a_parameter_it_does_not_take_is_refused_when_built():
    """Built, it would fail every call: each sample would score the failure score and the run train on nothing."""
    from rlbus.common.config import ConfigError
    from rlbus.reward.base import combine

    with pytest.raises(ConfigError, match=r"reward term 'format': parameters \['patern'\] do not fit it; it takes "
                                          r"pattern, tags"):
        combine([("math", 1.0, {}), ("format", 0.5, {"patern": "x"})])

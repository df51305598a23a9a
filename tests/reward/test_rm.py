"""The reward-model scorer batches and matches a plain forward pass, on a tiny random model built here."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_rm(tiny_model, tmp_path_factory):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tiny_model)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)
    path = tmp_path_factory.mktemp("rm")
    LlamaForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_batched_scores_equal_one_by_one_forward_passes(tiny_rm):
    from rlbus.reward.rm import RewardModel

    rm = RewardModel(tiny_rm, batch_size=3)
    prompts = ["What is 2 + 2?"] * 5
    responses = ["4", "It is four.", "5", "", "A much longer answer that pads the others in its batch"]
    batched = rm.score(prompts, responses)
    single = [RewardModel.score(rm, [p], [r])[0] for p, r in zip(prompts, responses)]
    assert len(batched) == 5 and len(set(round(x, 4) for x in batched)) > 1
    assert batched == pytest.approx(single, abs=1e-4)


def test_rm_as_a_reward_plugin(tiny_rm):
    from rlbus.reward.base import Response, evaluate, resolve

    r = evaluate(resolve("rm"), {"prompt": "hi"}, Response("hello"))
    assert r.score == 0.0 and "params.path" in r.reason
    import functools

    r = evaluate(functools.partial(resolve("rm"), path=tiny_rm), {"prompt": "hi"}, Response("hello"))
    assert r.details["model"] == tiny_rm and isinstance(r.score, float)


def test_a_config_with_the_rm_reward_and_no_model_is_refused():
    """reward.fn=rm (which can carry no path) scored every sample 0; now an error that says how to give one."""
    from rlbus.common.config import ConfigError, load_config
    from rlbus.reward.base import from_config

    for sets in (["reward.fn=rm"], ["reward.terms=[{fn: rm, weight: 1.0}, {fn: exact, weight: 1.0}]"]):
        with pytest.raises(ConfigError, match=r"the rm reward needs its model: reward.terms: \[\{fn: rm"):
            from_config(load_config(None, sets, environ={}).reward)
    from_config(load_config(None, ["reward.terms=[{fn: rm, weight: 1.0, params: {path: /m}}]"], environ={}).reward)
    from_config(load_config(None, ["reward.fn=rm", "reward.service=rm"], environ={}).reward)  # a worker scores


def test_a_reward_model_worker_turns_a_score_that_is_not_finite_into_the_failure_score(tiny_rm, tmp_path):
    """A reward model whose head gives NaN (a real model, its score head's weights made NaN): the worker answers
    the failure score with the reason, as for any reward, not a NaN the broker would refuse."""
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    from rlbus.common.config import load_config
    from rlbus.reward.worker import RewardWorker

    model = LlamaForSequenceClassification.from_pretrained(tiny_rm)
    with torch.no_grad():
        model.score.weight.fill_(float("nan"))
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_rm).save_pretrained(tmp_path)
    cfg = load_config(None, [f"reward.rm_path={tmp_path}", "reward.failure_score=-1.0"], environ={})
    results = RewardWorker(cfg, ["rm"], "rm-worker").handlers["rm"]([{"task": {"prompt": "hi"}, "text": "hello"}])
    assert results == [{"score": -1.0, "details": {"raw_score": "nan"}, "reason": "reward was not a finite number"}]

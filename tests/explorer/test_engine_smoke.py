"""The engine samples n responses per prompt with one finite logprob per sampled token."""

import math

import pytest

from rlbus.explorer.engine import Engine, inline_core
from tests.conftest import TINY_KV_MB


def test_generate_shapes_and_logprobs(engine):
    prompt = engine.chat_prompt([{"role": "user", "content": "What is 2 + 3? Answer with just the number."}])
    groups = engine.generate([prompt, prompt], n=4, max_tokens=8)
    assert len(groups) == 2 and all(len(g) == 4 for g in groups)
    for s in groups[0]:
        assert 1 <= len(s.token_ids) <= 8 and len(s.logprobs) == len(s.token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in s.logprobs)


def test_an_engine_on_cpu_compiles_nothing(engine):
    """Its model is not compiled (enforce_eager) and neither is the sampler's op that torch.compile would build at
    the first sample (2.1-3.0 s of each engine's warm-up)."""
    from torch._dynamo.utils import counters
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU build: a GPU engine keeps its compiled sampler op")
    prompt = engine.chat_prompt([{"role": "user", "content": "Count to five."}])
    assert len(engine.generate([prompt], n=3, max_tokens=8)[0]) == 3
    assert engine.inline and counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])


def test_engine_core_placement_is_checked():
    assert inline_core("inline") is True and inline_core("process") is False
    with pytest.raises(ValueError, match="auto, inline or process"):
        inline_core("threads")
    with pytest.raises(ValueError, match="explorer.threads sets the threads of an engine core inline"):
        Engine("no-model-is-loaded", core="process", threads=1)


def test_the_kv_cache_has_the_size_asked_for_whatever_the_host_memory(engine):
    # The shared engine asks for TINY_KV_MB (explorer.kv_cache_mb), not a share of the host's memory.
    config = engine.llm.llm_engine.vllm_config
    hf = config.model_config.hf_config
    per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * (hf.hidden_size // hf.num_attention_heads) * 4
    tokens = config.cache_config.num_gpu_blocks * config.cache_config.block_size
    assert tokens * per_token == TINY_KV_MB << 20


def test_a_prompt_the_engine_cannot_hold_is_an_error_naming_it_and_one_that_cuts_responses_a_warning(engine,
                                                                                                     tiny_model,
                                                                                                     tmp_path):
    """The engine (max_model_len 512 here) holds prompt and response of a sample: a task whose prompt fills it is
    refused before vLLM sees it, naming the task and the setting, and one that leaves fewer tokens than
    rollout.max_tokens is said once, its responses ending where the engine's room does."""
    import time

    from structlog.testing import capture_logs

    from rlbus.explorer.rollout import PromptTooLong, context_tokens, greedy_accuracy, roll_out
    from rlbus.reward.base import resolve

    def lease(i: int, words: int) -> dict:
        task = {"prompt": " ".join(["seven"] * words), "answer": "7", "kind": "arith", "task_id": f"long-{i}"}
        return {"lease_id": f"l{i}", "task_id": f"long-{i}", "seq": i, "batch_index": 0, "task": task}

    kw = dict(repeat=2, temperature=1.0, top_p=1.0, max_tokens=64, reward_fn=resolve("arith"), reward_name="arith",
              explorer="x", leased_at=time.monotonic())
    with pytest.raises(PromptTooLong, match=r"task 'long-0': its prompt is \d+ tokens and the engine holds 512 a "
                                            r"sample \(explorer.max_model_len\)"):
        roll_out(engine, [lease(0, 600)], **kw)
    with pytest.raises(PromptTooLong, match="task 'long-0'"):
        greedy_accuracy(engine, [lease(0, 600)["task"]], resolve("arith"), 8, "arith")
    prompt = engine.chat_prompt([{"role": "user", "content": lease(1, 480)["task"]["prompt"]}])
    room = 512 - len(prompt)
    assert 0 < room < 64
    with capture_logs() as logs:
        groups = roll_out(engine, [lease(1, 480), lease(2, 480)], **kw)
    cut = [e for e in logs if e["event"] == "responses_cut_by_the_context"]
    assert len(cut) == 1 and cut[0]["max_model_len"] == 512 and f"end after {room} tokens" in cut[0]["hint"]
    assert all(meta["n_tokens"] <= room for group in groups for meta, _ in group)
    assert (context_tokens(0, 24), context_tokens(0, 2000), context_tokens(4096, 24)) == (1024, 2512, 4096)
    assert (context_tokens(0, 2000, 1024), context_tokens(0, 2000, 8192), context_tokens(4096, 24, 1024)) == \
        (1024, 2512, 4096)  # within the model's context, unless told
    from rlbus.weights.models import model_context

    assert (model_context(tiny_model), model_context(str(tmp_path))) == (1024, None)  # no config.json there


def test_an_episode_whose_conversation_fills_the_engine_ends_there(engine):
    """A multi-turn episode takes another turn only while the conversation leaves the engine room for one."""
    import time

    from rlbus.explorer.envs import make_env
    from rlbus.explorer.rollout import roll_out
    from rlbus.reward.base import resolve

    task = {"prompt": " ".join(["seven"] * 470), "answer": "7", "low": 1, "high": 9, "max_turns": 50, "env": "guess",
            "kind": "guess", "task_id": "guess-long"}
    leases = [{"lease_id": "g0", "task_id": "guess-long", "seq": 0, "batch_index": 0, "task": task}]
    groups = roll_out(engine, leases, make_env=make_env, repeat=2, temperature=1.0, top_p=1.0, max_tokens=8,
                      reward_fn=resolve("guess"), reward_name="guess", explorer="x", leased_at=time.monotonic())
    prompt = engine.chat_prompt([{"role": "user", "content": task["prompt"]}])
    for meta, _ in groups[0]:
        assert len(prompt) + meta["n_tokens"] <= 512 + 40  # the last environment answer may pass the engine's room


def test_a_model_without_a_chat_template_takes_prompts_as_plain_text_and_refuses_multi_turn_tasks(engine):
    """A base model has no chat template: the engine gives it each prompt's text as it stands (transformers would
    raise at the first rollout), and a multi-turn task, whose turns need a template, is refused naming why."""
    import time
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from rlbus.explorer.envs import make_env
    from rlbus.explorer.rollout import Rollouts
    from rlbus.reward.base import resolve

    tok = AutoTokenizer.from_pretrained(engine.tokenizer.name_or_path)
    tok.chat_template = None
    base = SimpleNamespace(tokenizer=tok, max_model_len=512, version=0)
    base.chat_prompt = lambda messages: Engine.chat_prompt(base, messages)
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    assert base.chat_prompt(question) == tok.encode("What is 2 + 3?") != engine.chat_prompt(question)
    rollouts = Rollouts(base, repeat=2, temperature=1.0, top_p=1.0, max_tokens=8, reward_fn=resolve("guess"),
                        reward_name="guess", explorer="x", make_env=make_env)
    task = {"prompt": "Guess", "answer": "3", "low": 1, "high": 9, "max_turns": 3, "env": "guess", "task_id": "g"}
    with pytest.raises(ValueError, match="task g is multi-turn, which puts the environment's words into the "
                                         "conversation through the model's chat template; this model has none"):
        rollouts.add([{"lease_id": "l", "task_id": "g", "seq": 0, "batch_index": 0, "task": task}], time.monotonic())

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

"""Shared-prompt training: the packed layout computes what one row per sample computes, with fewer tokens."""

from __future__ import annotations

from contextlib import closing

import numpy as np
import pytest
import torch

from rlbus.trainer.batch import Sample, build_batch
from rlbus.trainer.packing import pack, packed_token_logprobs
from tests.helpers.weights import assert_same_weights

SYSTEM = [5, 6, 7, 8, 9]  # a prefix common to every prompt, like a chat template's system prompt


def rows(prompts_and_responses: list[tuple[list[int], list[int]]], rewards: list[float] | None = None):
    """A batch (group = index of the distinct prompt) of the given prompt/response token lists."""
    distinct: dict[tuple, int] = {}
    samples = []
    for i, (prompt, response) in enumerate(prompts_and_responses):
        g = distinct.setdefault(tuple(prompt), len(distinct))
        reward = rewards[i] if rewards else float(i % 2)
        samples.append(Sample(f"s{i}", g, reward, 0, 0, np.array(prompt), np.array(response),
                              np.full(len(response), -1.0, dtype=np.float32), np.ones(len(response), np.uint8)))
    return build_batch(samples, {}, "grpo", False, pad_id=0)


def example(seed: int = 0, prompts: int = 3, per_prompt: int = 4, vocab: int = 1000):
    rng = np.random.default_rng(seed)
    items = []
    for p in range(prompts):
        prompt = SYSTEM + rng.integers(10, vocab, 3 + p).tolist()
        for _ in range(per_prompt):
            items.append((prompt, rng.integers(10, vocab, int(rng.integers(1, 7))).tolist()))
    rng.shuffle(items)  # a group's samples need not be next to each other
    return rows(items)


def test_layout_shares_the_common_prefix_and_each_groups_prompt():
    batch = rows([(SYSTEM + [20, 21], [30, 31, 32]), (SYSTEM + [20, 21], [40]), (SYSTEM + [22], [50, 51])])
    p = pack(batch.input_ids, batch.attention_mask, batch.prompt_lens)
    assert p.input_ids[0].tolist() == SYSTEM + [20, 21, 30, 31, 32, 40, 22, 50, 51]
    assert p.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 7, 5, 6, 7]
    sees = {i: p.allowed[i].nonzero().flatten().tolist() for i in range(p.tokens)}
    assert sees[4] == [0, 1, 2, 3, 4]  # the prefix is causal
    assert sees[9] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # response 1: prefix, its prompt, itself
    assert sees[10] == [0, 1, 2, 3, 4, 5, 6, 10]  # response 2 does not see response 1
    assert sees[13] == [0, 1, 2, 3, 4, 11, 12, 13]  # the other group sees neither group-1 prompt nor responses
    # Each row's response token is predicted where its own row would predict it: the first by the last
    # prompt token (shared by the group), the next ones by the response's own previous token.
    assert p.predictor[0, 6:9].tolist() == [6, 7, 8]
    assert p.predictor[1, 6].item() == 6
    assert p.predictor[2, 5:7].tolist() == [11, 12]
    assert p.tokens < int(batch.attention_mask.sum())


def test_a_batch_of_one_prompt_packs_it_once():
    batch = rows([(SYSTEM, [1, 2]), (SYSTEM, [3])])
    p = pack(batch.input_ids, batch.attention_mask, batch.prompt_lens)
    assert p.input_ids[0].tolist() == SYSTEM + [1, 2, 3]
    assert p.predictor[1, 4].item() == 4  # both first tokens predicted by the last prompt token


def test_prompt_length_outside_the_row_is_refused():
    batch = rows([(SYSTEM, [1, 2])])
    with pytest.raises(ValueError, match="prompt length"):
        pack(batch.input_ids, batch.attention_mask, torch.tensor([9]))


def _logprobs_and_grads(model, batch, packed: bool, autocast: bool = False):
    """Token logprobs, entropies and the flat gradient of a policy-gradient loss, on the model's device."""
    from rlbus.trainer.model import token_logprobs

    device = next(model.parameters()).device
    ids, att = batch.input_ids.to(device), batch.attention_mask.to(device)
    mask, adv = batch.loss_mask.to(device), batch.advantages.to(device)
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        if packed:
            p = pack(batch.input_ids, batch.attention_mask, batch.prompt_lens)
            logp, entropy = packed_token_logprobs(model, p, ids, with_entropy=True, positions=mask)
        else:
            logp, entropy = token_logprobs(model, ids, att, with_entropy=True, positions=mask)
    loss = -(logp * mask * adv[:, None]).sum() / mask.sum()
    loss.backward()
    grads = torch.cat([q.grad.flatten() for q in model.parameters() if q.grad is not None])
    return logp.detach(), entropy, grads


def assert_packed_equals_rows(model, batch, bfloat16: bool = True) -> None:
    """Packed and one-row-per-sample logprobs, entropies and gradients agree, in float32 and (unless told
    otherwise) in bfloat16."""
    rows_logp, rows_entropy, rows_grad = _logprobs_and_grads(model, batch, packed=False)
    packed_logp, packed_entropy, packed_grad = _logprobs_and_grads(model, batch, packed=True)
    assert (rows_logp != 0).sum() == batch.loss_mask.sum()
    torch.testing.assert_close(packed_logp, rows_logp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(packed_entropy, rows_entropy, atol=2e-4, rtol=1e-5)
    # Summation order differs (a shared prompt token sums its responses' gradients in one pass): compare the
    # gradient as a whole, not element by element.
    assert ((packed_grad - rows_grad).norm() / rows_grad.norm()).item() < 1e-4
    if not bfloat16:
        return
    # In bfloat16 autocast the two agree as closely as two bfloat16 computations can: bfloat16 keeps 8 significant
    # bits, so logits (and logprobs) of magnitude 16 to 32 are rounded to 0.125; an absolute bound of 0.15 failed
    # on a CPU that computes in bfloat16 (packed -14.0909, rows -14.0558: 1% apart). A misplaced predictor is
    # nats off.
    bf_rows, _, bf_rows_grad = _logprobs_and_grads(model, batch, packed=False, autocast=True)
    bf_packed, _, bf_packed_grad = _logprobs_and_grads(model, batch, packed=True, autocast=True)
    torch.testing.assert_close(bf_packed, bf_rows, rtol=2 ** -6, atol=2 ** -4)
    cosine = torch.nn.functional.cosine_similarity(bf_packed_grad, bf_rows_grad, dim=0)
    assert cosine > 0.99


@pytest.mark.parametrize("model_name", ["tiny", "smollm2-135m"])
def test_packed_logprobs_and_gradients_equal_one_row_per_sample(model_name, tiny_model):
    """The tiny model is checked in float32 and bfloat16 everywhere; the bundled model in bfloat16 only where the
    CPU computes in it (emulated, its four bfloat16 passes took 47 s of this test's 58 on two AVX2 cores)."""
    from transformers import AutoModelForCausalLM

    from rlbus.trainer.model import autocast_dtype
    from rlbus.weights.models import resolve_model

    path = tiny_model if model_name == "tiny" else resolve_model("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    native = autocast_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert_packed_equals_rows(model, example(vocab=model.config.vocab_size), bfloat16=model_name == "tiny" or native)


def test_trainer_step_is_the_same_with_and_without_shared_prompts(tiny_model, tmp_path):
    from rlbus.common.config import load_config
    from rlbus.trainer.main import Trainer

    batch = example(seed=3)
    after = {}
    for shared in (False, True):
        cfg = load_config(None, [f"run.dir={tmp_path}/run{shared}", "trainer.lr=1e-3", "trainer.micro_batch=5",
                                 f"trainer.shared_prompt={shared}", "rollout.dtype=float32"], environ={})
        with closing(Trainer(cfg, tiny_model)) as trainer:
            metrics = trainer.train_on(batch)
            after[shared] = (metrics, torch.cat([q.detach().flatten() for q in trainer.model.parameters()]))
    (m_rows, w_rows), (m_packed, w_packed) = after[False], after[True]
    assert m_packed["loss"] == pytest.approx(m_rows["loss"], abs=1e-6)
    assert m_packed["grad_norm"] == pytest.approx(m_rows["grad_norm"], rel=1e-4)
    assert_same_weights({"all": w_packed}, {"all": w_rows}, lr=1e-3)
    assert m_packed["forward_tokens"] < m_rows["forward_tokens"]

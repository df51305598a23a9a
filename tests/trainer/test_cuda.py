"""The trainer on one CUDA GPU: shared-prompt packing under CUDA's attention, and a step equal to the CPU's.

The trainer takes plain (eager) attention on the CPU, and on CUDA when `trainer.deterministic` is on (the
default), since SDPA's fused CUDA kernels add gradients in no fixed order. The step test therefore compares
eager with eager; SDPA's CUDA path, which `trainer.deterministic=false` takes, is checked by the packing
equality. Run on a host with an NVIDIA GPU, no vLLM needed:

    .venv/bin/python -m pytest -m gpu tests/trainer/test_cuda.py

Here, without a GPU, every test skips and says why.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.weights import assert_same_weights
from tests.trainer.test_packing import SYSTEM, assert_packed_equals_rows, example, rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")]


def test_packed_logprobs_and_gradients_equal_one_row_per_sample_on_cuda(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).to("cuda")
    model.train()
    assert model.config._attn_implementation == "sdpa"
    assert_packed_equals_rows(model, example(vocab=model.config.vocab_size))


def test_a_trainer_step_on_cuda_is_the_cpu_step(tiny_model, tmp_path):
    # Same batch, same starting weights, float32 on both: the step's figures and the weights it leaves agree
    # to float32 rounding (the kernels differ, so not bit for bit).
    from rlbus.common.config import load_config
    from rlbus.trainer.main import Trainer

    batch = example(seed=3)
    after = {}
    for device in ("cpu", "cuda"):
        cfg = load_config(None, [f"run.dir={tmp_path}/{device}", "trainer.lr=1e-3", "trainer.micro_batch=5",
                                 f"trainer.device={device}", "rollout.dtype=float32", "sync.serve=false"],
                          environ={})
        trainer = Trainer(cfg, tiny_model)
        metrics = trainer.train_on(batch)
        after[device] = (metrics, torch.cat([q.detach().flatten().cpu() for q in trainer.model.parameters()]))
        assert next(trainer.model.parameters()).device.type == device
    (m_cpu, w_cpu), (m_cuda, w_cuda) = after["cpu"], after["cuda"]
    for key in ("loss", "entropy", "forward_tokens"):
        assert m_cuda[key] == pytest.approx(m_cpu[key], rel=1e-4, abs=1e-6), key
    assert m_cuda["grad_norm"] == pytest.approx(m_cpu["grad_norm"], rel=1e-3)
    assert_same_weights({"all": w_cuda}, {"all": w_cpu}, lr=1e-3)


def long_batch(seed: int, prompts: int = 8, per_prompt: int = 4, prompt_tokens: int = 400):
    """Long prompts, as in a multi-turn or few-shot task: packed, one sequence of about 4,000 tokens."""
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(prompts):
        prompt = SYSTEM + rng.integers(10, 1000, prompt_tokens).tolist()
        items += [(prompt, rng.integers(10, 1000, int(rng.integers(10, 60))).tolist()) for _ in range(per_prompt)]
    return rows(items)


@pytest.mark.parametrize("shared_prompt", [True, False])
def test_deterministic_training_on_cuda_repeats_bit_for_bit(tiny_model, tmp_path, shared_prompt):
    # `trainer.deterministic` promises the same weights from the same batches. CUDA's fused attention kernels
    # split a long sequence's keys over thread blocks and add their gradients in no fixed order (torch only
    # warns, under warn_only), so three steps on long batches, run twice, must agree in every bit.
    from rlbus.common.config import load_config
    from rlbus.trainer.main import Trainer

    runs = []
    for attempt in range(2):
        cfg = load_config(None, [f"run.dir={tmp_path}/{attempt}", "trainer.lr=1e-3", "trainer.micro_batch=32",
                                 "trainer.device=cuda", "trainer.deterministic=true", "rollout.dtype=float32",
                                 f"trainer.shared_prompt={shared_prompt}", "sync.serve=false"], environ={})
        trainer = Trainer(cfg, tiny_model)
        norms = [trainer.train_on(long_batch(seed=s))["grad_norm"] for s in (3, 4, 5)]
        runs.append((norms, [q.detach().cpu().clone() for q in trainer.model.parameters()]))
    (norms_a, weights_a), (norms_b, weights_b) = runs
    assert norms_a == norms_b
    assert all(torch.equal(a, b) for a, b in zip(weights_a, weights_b))


def test_auto_precision_on_cuda_trains_and_publishes_in_bfloat16(tiny_model, tmp_path):
    # `trainer.autocast: auto` and `rollout.dtype: auto` (the default) on a GPU that computes in bfloat16: the
    # trainer steps under bfloat16 autocast and its run records (and publishes in) bfloat16.
    from rlbus.common.config import load_config
    from rlbus.trainer.main import Trainer
    from rlbus.weights.models import rollout_dtype

    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU does not compute in bfloat16")
    cfg = load_config(None, [f"run.dir={tmp_path}", "trainer.device=cuda", "trainer.autocast=auto", "sync.serve=false"],
                      environ={})
    assert cfg.rollout.dtype == "auto"
    trainer = Trainer(cfg, tiny_model)
    assert (trainer.autocast, trainer.autocast_name) == (torch.bfloat16, "bfloat16")
    assert trainer.cfg.rollout.dtype == rollout_dtype("auto") == "bfloat16"
    metrics = trainer.train_on(example(seed=3))
    assert all(np.isfinite(metrics[k]) for k in ("loss", "entropy", "grad_norm"))

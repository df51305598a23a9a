"""The policy (and, with a KL term, a frozen reference) as HF transformers models, and their token logprobs."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F

from rlbus.common.config import RunConfig
from rlbus.weights.models import cpu_prefers_bfloat16

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """What `trainer.autocast` computes in on `device`; None: no autocast. `auto` takes bfloat16 where the
    hardware computes in it (a CUDA GPU that supports it; a CPU with AVX512-BF16 or AMX on which bfloat16 was
    also timed faster: `rlbus.weights.precision`) and float32 elsewhere: on a CPU without them bfloat16 is
    emulated, and a step takes about 25 times as long as in float32 (SmolLM2-135M, a 600-token forward and
    backward on two AVX2 cores: 150 s against 6 s)."""
    if setting != "auto":
        return DTYPES.get(setting)  # "off": None
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    return torch.bfloat16 if device.type == "cpu" and cpu_prefers_bfloat16() else None


def load_model(path: str, cfg: RunConfig, trainable: bool = True, device: str | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[cfg.model.dtype]).to(device or cfg.trainer.device)
    if trainable:
        model.train()
        if cfg.trainer.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        # Sampling has no dropout: training must see the same distribution.
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    else:
        model.eval().requires_grad_(False)
    return model


def frozen_in(model, dtype: torch.dtype | None) -> None:
    """Keep a frozen model's linear weights in `dtype`, the one autocast computes them in: autocast would cast
    each of them at every forward (it caches only the casts of weights that take gradients), and a cast done
    once gives the same values. Everything else keeps its dtype (norms, the embedding a tied LM head shares:
    the head gets a copy of its own; a model's own linear-like modules, such as a router that computes in
    float32), so a model whose `nn.Linear`s all run under autocast, as HF decoders', computes bit for bit as
    before."""
    if dtype is None:
        return
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            for name, param in list(module.named_parameters(recurse=False)):
                setattr(module, name, torch.nn.Parameter(param.detach().to(dtype), requires_grad=False))


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, positions: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(token t+1 | tokens <= t), [B, T-1]; optionally the entropy there.

    With `positions` (a [B, T-1] mask), the LM head and the softmax over the
    vocabulary run only where it is set (elsewhere the result is 0): for a
    135M model with a 49k vocabulary they are a large part of the cost, and
    prompt positions are never trained.
    """
    decoder = model.get_decoder()
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]
    targets = input_ids[:, 1:]
    where = positions.bool() if positions is not None else torch.ones_like(targets, dtype=torch.bool)
    return logprobs_at(model, hidden[where], targets, where, temperature, with_entropy)


def logprobs_at(model, hidden: torch.Tensor, targets: torch.Tensor, where: torch.Tensor, temperature: float,
                with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """From the hidden states that predict the targets where `where` is set ([K, H], in `where`'s order):
    the [B, T-1] log-probabilities of `targets` there (0 elsewhere) and optionally the entropy."""
    logits = model.get_output_embeddings()(hidden).float()
    if temperature and temperature != 1.0:
        logits = logits / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logp = torch.zeros(targets.shape, dtype=logp_all.dtype, device=logp_all.device)
    logp[where] = logp_all.gather(-1, targets[where][:, None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = torch.zeros_like(logp)
            entropy[where] = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

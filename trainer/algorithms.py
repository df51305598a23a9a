"""Advantage estimators and the policy loss: pure tensor functions, no I/O.

Advantages take the rewards of a batch and the group each belongs to (a
group = the `repeat` samples of one task):

- `grpo`: (r - group mean) / (group std + eps), std with Bessel's correction;
- `grpo_batch`: (r - group mean) / (batch std + eps), the std of every
  reward in the batch (TRL's `scale_rewards: batch`): groups whose rewards
  barely differ are not blown up to unit scale. All-equal groups count in
  that std, so `skip_zero_spread` is off for it unless set;
- `dr_grpo`: r - group mean (no std: Dr. GRPO);
- `rloo`: r - mean of the *other* samples of the group = G/(G-1) (r - mean);
- `reinforce_pp`: REINFORCE++'s normalisation over the batch's tokens, no group
  baseline: every response token carries its sample's reward, and the mean and
  (Bessel-corrected) variance are taken over those tokens, so a sample counts
  as many times as it has tokens the loss sees: (r - mean) / sqrt(var + 1e-8).

The first three give every sample of a group whose rewards are all equal an
advantage of zero: such groups cost a forward and backward pass for no
gradient, so the trainer drops them first (`group_relative`).

The policy loss is PPO's clipped objective with the decoupled off-policy
correction: the ratio is taken against the proximal policy (logprobs the
trainer computes at the start of the step, detached), and each token is
weighted by w = exp(logp_proximal - logp_behaviour), the behaviour logprobs
being the explorer's. w is truncated at `is_cap` (mode `truncate`) or tokens
with w outside [is_low, is_high] are masked (mode `mask`). With one update per
fetched batch the proximal policy *is* the current one: its logprobs are the
current forward's, detached, and the ratio is 1 in value with the gradient of
log pi. With several (`algorithm.mini_batches`, `algorithm.epochs`) it is the
policy before the batch's first update (trainer/learner.py).

`ratio_level: sequence` is GSPO's ratio: every token of a sequence takes the
exp of the mean, over its response tokens, of log pi - log pi_proximal, and
is clipped with it (the whole sequence in or out of the clip range), as
TRL's `importance_sampling_level: sequence` and verl's `gspo` loss. The
gradient of a sequence's tokens is then its ratio times the sum of their
log pi gradients (over token-mean aggregation), where a token ratio weighs
each token by its own. The importance weight to the behaviour policy stays
per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GROUP_RELATIVE = frozenset({"grpo", "grpo_batch", "dr_grpo", "rloo"})


def group_relative(name: str) -> bool:
    return name in GROUP_RELATIVE


def advantages(rewards: torch.Tensor, group_ids: torch.Tensor, estimator: str = "grpo",
               eps: float = 1e-6, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """One advantage per sample. `group_ids` are integers labelling each sample's group; `tokens`, each
    sample's count of response tokens in the loss, weighs the samples for `reinforce_pp` (one each if absent)."""
    rewards = rewards.double()
    if estimator == "reinforce_pp":
        return _token_whitened(rewards, torch.ones_like(rewards) if tokens is None else tokens.double()).float()
    out = torch.empty_like(rewards)
    batch_std = rewards.std(unbiased=True) if rewards.numel() > 1 else rewards.new_tensor(0.0)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        r = rewards[idx]
        n = r.numel()
        centred = r - r.mean()
        if estimator == "grpo":
            std = r.std(unbiased=True) if n > 1 else r.new_tensor(0.0)
            out[idx] = centred / (std + eps)
        elif estimator == "grpo_batch":
            out[idx] = centred / (batch_std + eps)
        elif estimator == "dr_grpo":
            out[idx] = centred
        elif estimator == "rloo":
            out[idx] = centred * (n / (n - 1)) if n > 1 else centred * 0
        else:
            raise ValueError(f"unknown advantage estimator {estimator!r}")
    return out.float()


def _token_whitened(rewards: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Rewards whitened over the tokens that carry them: sample i counts `tokens[i]` times."""
    if tokens.sum() <= 0:
        tokens = torch.ones_like(rewards)
    n = tokens.sum()
    mean = (tokens * rewards).sum() / n
    var = (tokens * (rewards - mean).square()).sum() / (n - 1) if n > 1 else rewards.new_tensor(0.0)
    return (rewards - mean) * torch.rsqrt(var + 1e-8)


def zero_spread_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> set[int]:
    """Groups whose rewards are all equal."""
    return {int(g) for g in torch.unique(group_ids)
            if rewards[group_ids == g].max() == rewards[group_ids == g].min()}


def kl_estimate(logp: torch.Tensor, logp_ref: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimates of KL(pi || ref) from tokens sampled from pi, with x = logp - logp_ref.

    k1 = x, k2 = x^2 / 2, k3 = exp(-x) + x - 1. As a loss term (no score
    function, the tokens' sampling distribution held fixed), their gradients
    differ: k2's is x grad logp, whose expectation is the gradient of
    KL(pi || ref); k3's is (1 - ref/pi) grad logp, whose expectation is the
    gradient of the *forward* KL(ref || pi). For small x the two agree, but
    for a token that pi has learnt to avoid and ref favours, k3's weight
    1 - ref/pi grows without bound and pulls the token back up, against a
    negative advantage; k2's grows with the log ratio only.
    """
    log_ratio = logp - logp_ref
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    raise ValueError(f"unknown KL estimator {kind!r}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", max_tokens: int = 1
              ) -> torch.Tensor:
    """Reduce [batch, time] token losses to a scalar over the tokens `mask` keeps. `seq-mean-token-sum-norm` is
    Dr. GRPO's: each sequence's sum over a constant, `max_tokens` (the longest response the run samples), so
    neither a sequence's length nor the batch's token count scales its tokens' gradients."""
    mask = mask.to(per_token.dtype)
    if mode == "token-mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    per_seq = (per_token * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        return (per_seq / mask.sum(-1).clamp(min=1)).mean()
    if mode == "seq-mean-token-sum":
        return per_seq.mean()
    if mode == "seq-mean-token-sum-norm":
        return per_seq.mean() / max_tokens
    raise ValueError(f"unknown loss aggregation {mode!r}")


@dataclass
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None  # c > 1: bounds the loss of negative-advantage tokens by -c * A
    is_mode: str = "truncate"  # or "mask"
    is_cap: float = 2.0
    is_low: float = 0.5
    is_high: float = 2.0
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    kl_clamp: float | None = None  # bound on each token's KL estimate (beyond it, no gradient)
    aggregation: str = "token-mean"
    max_tokens: int = 1  # the constant of `seq-mean-token-sum-norm`: rollout.max_tokens
    ratio_level: str = "token"  # or "sequence" (GSPO): each token's ratio is its sequence's geometric mean


def policy_loss(logp: torch.Tensor, logp_prox: torch.Tensor, logp_behaviour: torch.Tensor, adv: torch.Tensor,
                mask: torch.Tensor, cfg: LossConfig, logp_ref: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """The PPO-clip loss with decoupled importance weights; tensors are [batch, time], `adv` is [batch].

    Returns the scalar loss and its metrics (clip fraction, importance-weight
    statistics, KL).
    """
    mask = mask.bool()
    response = mask  # every response token: the denominator of aggregation and of the fractions below
    a = adv[:, None].to(logp.dtype)
    log_ratio = logp - logp_prox.detach()
    if cfg.ratio_level == "sequence":  # GSPO: exp of the mean log-ratio over the sequence's response tokens
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1))[:, None].expand_as(logp)
    elif cfg.ratio_level != "token":
        raise ValueError(f"unknown ratio level {cfg.ratio_level!r}")
    ratio = torch.exp(log_ratio)
    unclipped = -a * ratio
    clipped = -a * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if cfg.dual_clip is not None:
        per_token = torch.where(a < 0, torch.minimum(per_token, -a * cfg.dual_clip), per_token)
    w = torch.exp((logp_prox - logp_behaviour).detach())
    if cfg.is_mode == "truncate":
        weight = w.clamp(max=cfg.is_cap)
        limited = (w > cfg.is_cap) & mask
    elif cfg.is_mode == "mask":
        inside = (w >= cfg.is_low) & (w <= cfg.is_high)
        weight = inside.to(w.dtype)
        limited = ~inside & mask
        mask = mask & inside
    else:
        raise ValueError(f"unknown importance-weight mode {cfg.is_mode!r}")
    per_token = per_token * weight
    kl_mean = 0.0
    if logp_ref is not None and cfg.kl_coef:
        kl = kl_estimate(logp, logp_ref.detach(), cfg.kl_kind)
        bounded = kl if cfg.kl_clamp is None else kl.clamp(-cfg.kl_clamp, cfg.kl_clamp)
        per_token = per_token + cfg.kl_coef * bounded
        kl_mean = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1))  # the estimate itself, unbounded
    # Tokens the importance mask drops add zero but still count, so a batch split into micro-batches
    # (weighted by their share of response tokens) has the same loss and gradients as the whole.
    loss = aggregate(per_token * mask, response, cfg.aggregation, cfg.max_tokens)
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        clip_hit = ((clipped > unclipped) & mask).sum() / n
        wm = w[mask] if mask.any() else w.new_zeros(1)
        metrics = {"clip_fraction": float(clip_hit), "is_weight_mean": float(wm.mean()),
                   "is_weight_max": float(wm.max()), "is_weight_min": float(wm.min()),
                   "is_limited_fraction": float(limited.sum() / response.sum().clamp(min=1)), "kl": kl_mean}
    return loss, metrics


def lr_factor(t, step: int) -> float:
    """The multiple of `trainer.lr` used at optimizer step `step`: warm-up, then the schedule."""
    warm = t.warmup_steps
    if step < warm:
        return (step + 1) / warm
    if t.lr_schedule == "constant":
        return 1.0
    start = warm if not t.decay_steps else max(warm, t.total_steps - t.decay_steps)
    if step < start:  # warm-up, stable, decay
        return 1.0
    progress = min(1.0, (step - start) / max(1, t.total_steps - start))
    shape = 1 - progress if t.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * shape

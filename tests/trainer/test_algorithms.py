"""Advantages and the policy loss against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlbus.common.config import load_config
from rlbus.trainer.algorithms import (LossConfig, advantages, aggregate, group_relative, kl_estimate, policy_loss,
                                zero_spread_groups)

R = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
G = torch.tensor([0, 0, 0, 0, 1, 1])


def test_grpo():
    # group 0: mean 0.5, sample std sqrt(1/3) -> +-0.5 / 0.57735 = +-0.8660; group 1: all equal -> 0
    a = advantages(R, G, "grpo")
    assert torch.allclose(a, torch.tensor([0.8660, -0.8660, -0.8660, 0.8660, 0.0, 0.0]), atol=1e-4)


def test_dr_grpo_and_rloo():
    assert torch.allclose(advantages(R, G, "dr_grpo"), torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]))
    # RLOO: 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3
    assert torch.allclose(advantages(R, G, "rloo"), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0]), atol=1e-6)


def test_grpo_batch_divides_by_the_std_of_every_reward_in_the_batch():
    # group means 0.5 and 1; the batch's six rewards have std sqrt(4/15) = 0.5164, all-equal group 1 included
    a = advantages(R, G, "grpo_batch")
    assert torch.allclose(a, torch.tensor([0.9682, -0.9682, -0.9682, 0.9682, 0.0, 0.0]), atol=1e-4)
    assert group_relative("grpo_batch")
    cfg = load_config(None, ["algorithm.advantage=grpo_batch"], environ={}).algorithm
    assert not cfg.drops_zero_spread(), "all-equal groups count in the batch's std: kept unless asked"


def test_reinforce_pp_normalises_over_the_batch():
    # batch mean 2/3, sample std sqrt(4/15) = 0.5164; 1 -> 0.6455, 0 -> -1.2910
    a = advantages(R, G, "reinforce_pp")
    assert torch.allclose(a, torch.tensor([0.6455, -1.2910, -1.2910, 0.6455, 0.6455, 0.6455]), atol=1e-4)
    assert not group_relative("reinforce_pp") and group_relative("grpo")


def test_reinforce_pp_whitens_over_tokens_so_a_long_sample_weighs_more():
    rewards, tokens = torch.tensor([1.0, 0.0, 0.5]), torch.tensor([3.0, 1.0, 0.0])
    per_token = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the tokens the loss sees; the third sample has none
    mean, std = per_token.mean(), per_token.std(unbiased=True)  # 0.75, 0.5
    expected = (rewards - mean) / std
    assert torch.allclose(advantages(rewards, torch.arange(3), "reinforce_pp", tokens=tokens), expected, atol=1e-5)
    assert torch.allclose(expected, torch.tensor([0.5, -1.5, -0.5]))
    # Token counts of nothing weigh the samples alike rather than divide by zero.
    assert torch.allclose(advantages(rewards, torch.arange(3), "reinforce_pp", tokens=torch.zeros(3)),
                          advantages(rewards, torch.arange(3), "reinforce_pp"))


def test_zero_spread_groups():
    assert zero_spread_groups(R, G) == {1}


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)


@pytest.mark.parametrize("kind, forward", [("k2", False), ("k3", True)])
def test_kl_loss_gradient_in_expectation_is_that_of_the_reverse_or_the_forward_kl(kind, forward):
    """Over every token of a categorical, weighted by pi (the sampling distribution, held fixed as in the
    loss), k2's gradient is that of KL(pi || ref) and k3's that of KL(ref || pi)."""
    torch.manual_seed(0)
    logits = torch.randn(6, dtype=torch.float64, requires_grad=True)
    log_ref = torch.log_softmax(torch.randn(6, dtype=torch.float64), -1)

    def grad(of):
        logp = torch.log_softmax(logits, -1)
        return torch.autograd.grad(of(logp), logits)[0]

    estimated = grad(lambda logp: (logp.exp().detach() * kl_estimate(logp, log_ref, kind)).sum())
    reverse = grad(lambda logp: (logp.exp() * (logp - log_ref)).sum())
    forward_kl = grad(lambda logp: (log_ref.exp() * (log_ref - logp)).sum())
    want, other = (forward_kl, reverse) if forward else (reverse, forward_kl)
    assert torch.allclose(estimated, want, atol=1e-12)
    assert not torch.allclose(estimated, other, atol=1e-3)


@pytest.mark.filterwarnings("error::UserWarning")  # the KL figure is read without touching the graph
def test_k3_pulls_an_avoided_token_back_up_against_its_negative_advantage_and_k2_does_not():
    """A sampled token the policy gives 0.5% and the reference 50%, advantage -2: with kl_coef 0.04, k3's
    gradient outweighs the advantage's and raises the token; k2's does not."""
    def grad_of(kind):
        logp = torch.tensor([[math.log(0.005)]], dtype=torch.float64, requires_grad=True)
        loss, _ = policy_loss(logp, logp.detach(), logp.detach(), torch.tensor([-2.0], dtype=torch.float64),
                              torch.ones(1, 1, dtype=torch.bool), LossConfig(kl_coef=0.04, kl_kind=kind),
                              logp_ref=torch.tensor([[math.log(0.5)]], dtype=torch.float64))
        return torch.autograd.grad(loss, logp)[0].item()
    assert grad_of("k3") < 0 < grad_of("k2")  # descent raises logp under k3, lowers it under k2


def test_kl_clamp_leaves_a_token_beyond_the_bound_to_its_advantage_and_reports_the_estimate_itself():
    """The same avoided token (k3 = 100 + ln 0.01 - 1 = 94.4): with kl_clamp 10 its KL term adds a constant
    0.04 * 10 and no gradient, so the advantage alone lowers it; the logged kl is still 94.4. A token inside
    the bound keeps k3's gradient."""
    def loss_and_grad(p, ref, clamp):
        logp = torch.tensor([[math.log(p)]], dtype=torch.float64, requires_grad=True)
        loss, m = policy_loss(logp, logp.detach(), logp.detach(), torch.tensor([-2.0], dtype=torch.float64),
                              torch.ones(1, 1, dtype=torch.bool),
                              LossConfig(kl_coef=0.04, kl_kind="k3", kl_clamp=clamp),
                              logp_ref=torch.tensor([[math.log(ref)]], dtype=torch.float64))
        return loss.item(), torch.autograd.grad(loss, logp)[0].item(), m["kl"]
    loss, g, kl = loss_and_grad(0.005, 0.5, 10.0)
    assert kl == pytest.approx(100 + math.log(0.01) - 1)
    assert loss == pytest.approx(2.0 + 0.04 * 10) and g == pytest.approx(2.0)  # -A * ratio: d/dlogp = 2
    inside, unbounded = loss_and_grad(0.3, 0.5, 10.0), loss_and_grad(0.3, 0.5, None)
    assert inside == pytest.approx(unbounded) and inside[1] != pytest.approx(2.0)


def test_aggregations():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    # Dr. GRPO: the batch's token sum over (sequences x the constant), here max_tokens 8
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", 8).item() == pytest.approx((6 + 4) / (2 * 8))


def one_token(logp, prox, behav, adv, **kw):
    t = lambda v: torch.tensor([[v]], dtype=torch.float64)  # noqa: E731
    return policy_loss(t(logp), t(prox), t(behav), torch.tensor([adv], dtype=torch.float64),
                       torch.ones(1, 1, dtype=torch.bool), LossConfig(**kw))


def test_on_policy_loss_is_minus_advantage_and_gradient_is_minus_advantage():
    logp = torch.tensor([[-1.0]], requires_grad=True)
    loss, m = policy_loss(logp, logp.detach(), logp.detach(), torch.tensor([2.0]), torch.ones(1, 1), LossConfig())
    loss.backward()
    assert loss.item() == pytest.approx(-2.0) and logp.grad.item() == pytest.approx(-2.0)
    assert m["is_weight_mean"] == pytest.approx(1.0) and m["clip_fraction"] == 0.0


def test_ppo_clip_with_positive_and_negative_advantage():
    # ratio = e^0.5 = 1.6487 > 1.2: with A=+1 the clipped term -1.2 wins (max of -1.6487, -1.2)
    loss, m = one_token(-0.5, -1.0, -1.0, 1.0)
    assert loss.item() == pytest.approx(-1.2) and m["clip_fraction"] == 1.0
    # with A=-1: max(1.6487, 1.2) = 1.6487, not clipped
    loss, m = one_token(-0.5, -1.0, -1.0, -1.0)
    assert loss.item() == pytest.approx(math.exp(0.5)) and m["clip_fraction"] == 0.0


def test_sequence_ratio_is_gspos_as_trl_writes_it():
    """`ratio_level: sequence` against TRL's GRPO loss with importance_sampling_level sequence, written out: one
    ratio per sequence, exp of the masked mean log-ratio, clipped as one; the same loss and gradients. Sequences
    of different lengths (padding masked), both signs of advantage, some inside the clip range and some out."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    old = -torch.rand(4, 4) * 3
    new = old + torch.tensor([[2e-4], [-1e-3], [5e-5], [3e-3]]) + torch.randn(4, 4) * 1e-4
    adv = torch.tensor([1.0, -0.5, 2.0, 1.5])
    low, high = 3e-4, 4e-4
    mine = new.clone().requires_grad_(True)
    loss, m = policy_loss(mine, old, old, adv, mask, LossConfig(clip_low=low, clip_high=high, ratio_level="sequence"))
    loss.backward()

    theirs = new.clone().requires_grad_(True)
    log_ratio = theirs - old
    log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_weights)
    coef_2 = torch.clamp(coef_1, 1 - low, 1 + high)
    per_token = -torch.min(coef_1 * adv.unsqueeze(1), coef_2 * adv.unsqueeze(1))
    expected = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.allclose(mine.grad, theirs.grad, atol=1e-7)
    clipped = [bool(c) for c in (coef_1.squeeze(1) - 1).abs() > torch.tensor([high, low, high, high])]
    assert clipped == [False, True, False, True], "the case covers sequences inside and outside the range"
    assert m["clip_fraction"] == pytest.approx((2 + 1) / 10)  # the second's two tokens and the fourth's one
    # One update per batch, on policy (proximal and behaviour policies the current one): token ratios' gradient.
    grads = {}
    for level in ("sequence", "token"):
        logp = new.clone().requires_grad_(True)
        policy_loss(logp, logp.detach(), logp.detach(), adv, mask, LossConfig(ratio_level=level))[0].backward()
        grads[level] = logp.grad
    assert torch.allclose(grads["sequence"], grads["token"], atol=1e-7)
    assert grads["token"].abs().sum() > 0


def test_dual_clip_bounds_negative_advantage_losses():
    # ratio = e^2 = 7.389, A = -1: PPO gives 7.389, dual clip c=3 bounds it at 3
    loss, _ = one_token(1.0, -1.0, -1.0, -1.0, dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)


def test_importance_weight_truncate_and_mask():
    # on the proximal policy (ratio 1), behaviour logprob lower by log 3: w = 3
    loss, m = one_token(-1.0, -1.0, -1.0 - math.log(3), 1.0, is_cap=2.0)
    assert loss.item() == pytest.approx(-2.0) and m["is_weight_max"] == pytest.approx(3.0)
    assert m["is_limited_fraction"] == 1.0
    loss, m = one_token(-1.0, -1.0, -1.0 - math.log(1.5), 1.0)
    assert loss.item() == pytest.approx(-1.5) and m["is_limited_fraction"] == 0.0
    loss, m = one_token(-1.0, -1.0, -1.0 - math.log(3), 1.0, is_mode="mask", is_high=2.0)
    assert loss.item() == 0.0 and m["is_limited_fraction"] == 1.0


def test_kl_term_is_added_with_its_coefficient():
    # on-policy, A = 0: loss = beta * k1 = 0.1 * (-1 - (-1.5)) = 0.05
    t = lambda v: torch.tensor([[v]])  # noqa: E731
    loss, m = policy_loss(t(-1.0), t(-1.0), t(-1.0), torch.tensor([0.0]), torch.ones(1, 1),
                          LossConfig(kl_coef=0.1, kl_kind="k1"), logp_ref=t(-1.5))
    assert loss.item() == pytest.approx(0.05) and m["kl"] == pytest.approx(0.5)


def test_lr_schedules_warm_up_then_keep_or_decay_to_the_floor():
    from rlbus.common.config import load_config
    from rlbus.trainer.algorithms import lr_factor

    def factors(*sets, steps=12):
        t = load_config(None, ["trainer.total_steps=10", *sets], environ={}).trainer
        return [round(lr_factor(t, s), 4) for s in range(steps)]

    assert factors() == [1.0] * 12
    assert factors("trainer.warmup_steps=4")[:5] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert factors("trainer.lr_schedule=linear", "trainer.warmup_steps=2") == [
        0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0.0, 0.0]
    cosine = factors("trainer.lr_schedule=cosine", "trainer.min_lr_ratio=0.1")
    assert cosine[0] == 1.0 and cosine[5] == 0.55 and cosine[10:] == [0.1, 0.1]
    assert all(a >= b for a, b in zip(cosine, cosine[1:]))
    assert factors("trainer.lr_schedule=linear", "trainer.decay_steps=4", "trainer.warmup_steps=2") == [
        0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]  # warm-up, stable, decay
    assert factors("trainer.lr_schedule=linear", "trainer.decay_steps=40") == factors("trainer.lr_schedule=linear")


@pytest.mark.parametrize("is_mode", ["truncate", "mask"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                         "seq-mean-token-sum-norm"])
def test_loss_and_gradients_do_not_depend_on_the_micro_batch(aggregation, is_mode):
    """The trainer's split (each micro-batch weighted by its share of tokens or rows) sums to the whole batch,
    also when the importance mask drops tokens."""
    g = torch.Generator().manual_seed(0)
    rows, time_ = 6, 5
    mask = torch.rand(rows, time_, generator=g) > 0.3
    mask[:, 0] = True
    behaviour = -torch.rand(rows, time_, generator=g) * 2
    adv = torch.randn(rows, generator=g)
    cfg = LossConfig(is_mode=is_mode, is_low=0.7, is_high=1.3, is_cap=1.3, aggregation=aggregation, max_tokens=8)
    by_tokens = aggregation == "token-mean"
    total = mask.sum().item() if by_tokens else rows

    def run(micro: int):
        logp = (-torch.rand(rows, time_, generator=torch.Generator().manual_seed(1)) * 2).requires_grad_()
        whole = 0.0
        for start in range(0, rows, micro):
            sl = slice(start, start + micro)
            loss, m = policy_loss(logp[sl], logp[sl].detach() + 0.3 * behaviour[sl].abs(), behaviour[sl],
                                  adv[sl], mask[sl], cfg)
            assert 0.0 <= m["is_limited_fraction"] <= 1.0
            share = (mask[sl].sum().item() if by_tokens else mask[sl].shape[0]) / total
            (loss * share).backward()
            whole += loss.item() * share
        return whole, logp.grad.clone()

    loss_1, grad_1 = run(rows)
    for micro in (1, 2, 4):
        loss_m, grad_m = run(micro)
        assert loss_m == pytest.approx(loss_1, rel=1e-5, abs=1e-7)
        assert torch.allclose(grad_m, grad_1, atol=1e-6)

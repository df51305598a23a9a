"""The trainer's line for each step (`train_step`), written through the metrics sink: what the step trained on,
what it learned, and where its time went."""

from __future__ import annotations

from collections import Counter

import torch

from rlbus.common import metrics as metrics_sink
from rlbus.common.logging import significant
from rlbus.trainer.batch import Batch


def train_step(step: int, version: int, repeat: int, header: dict, batch: Batch | None, metrics: dict[str, float],
               *, wait_s: float, compute_s: float, publish_s: float, step_s: float, published: bool,
               core_wait) -> None:
    """`header`: the BATCH reply's (groups the broker left out, as `skipped` and `expired` samples)."""
    have = batch is not None
    rewards = batch.rewards if have else torch.empty(0)
    staleness = Counter(step - v for v in (batch.versions if have else []))
    adv = batch.advantages if have and batch.size else torch.zeros(1)
    tokens = batch.tokens if have and batch.size else 0
    repeat = max(1, repeat)
    metrics_sink.emit(
        "train_step", step=step, policy_version=step, new_version=version,
        groups=batch.groups if have else 0,
        groups_dropped=(batch.dropped_groups if have else 0) + header.get("skipped", 0) // repeat,
        groups_expired=header.get("expired", 0) // repeat,
        samples=batch.size if have else 0, rejected=batch.rejected if have else {},
        reward_mean=round(float(rewards.mean()), 4) if rewards.numel() else None,
        reward_std=round(float(rewards.std()), 4) if rewards.numel() > 1 else None,
        adv_mean=round(float(adv.mean()), 4), adv_std=round(float(adv.std()), 4) if adv.numel() > 1 else 0.0,
        adv_abs_max=round(float(adv.abs().max()), 4),
        **{k: significant(v) for k, v in metrics.items()},
        staleness={str(k): v for k, v in sorted(staleness.items())},
        version_span=batch.version_span if have else [], swapped=batch.swapped if have else 0, tokens=tokens,
        tokens_per_s=round(tokens / compute_s, 1) if compute_s > 0 else 0.0,
        wait_s=round(wait_s, 3), compute_s=round(compute_s, 3), publish_s=round(publish_s, 3),
        step_s=round(step_s, 3), published=published, core_wait=core_wait)

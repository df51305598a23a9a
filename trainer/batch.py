"""From a BATCH reply to padded training tensors.

Each trajectory is decoded and checked before it can reach the model: arrays
that are missing, not one-dimensional or of the wrong kind (token ids that are
not integers, logprobs that are not floats), NaN or infinite logprobs,
logprobs above zero, a loss mask with values other than 0 and 1, token ids
outside the vocabulary, empty responses and arrays of mismatched lengths are
rejected with a logged reason (the rest of the batch trains). Advantages are
computed per group over the samples that passed; groups whose rewards are all
equal are dropped when the estimator is group-relative.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import structlog
import torch

from rlbus.common import protocol as P
from rlbus.common.messages import Trajectory
from rlbus.common.trajectory import decode_payload
from rlbus.trainer.algorithms import advantages, group_relative, zero_spread_groups

log = structlog.get_logger()


@dataclass
class Sample:
    id: str
    group: int
    reward: float
    policy_version: int  # of its oldest token
    last_version: int  # of its newest token (newer when weights were swapped in while it was generated)
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    loss_mask: np.ndarray


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T-1] over predicted positions: 1 where a response token is trained
    behaviour_logprobs: torch.Tensor  # [B, T-1], aligned with loss_mask
    advantages: torch.Tensor  # [B]
    prompt_lens: torch.Tensor  # [B]: the first prompt_lens[b] tokens of row b are its prompt
    rewards: torch.Tensor  # [B]
    versions: list[int]
    ids: list[str]
    rejected: dict[str, int]
    dropped_groups: int
    groups: int
    fetched_samples: int = 0  # samples that passed the checks, all-equal groups included
    last_versions: list[int] = field(default_factory=list)  # per sample, as `versions`: its newest token's

    @property
    def version_span(self) -> list[int]:
        """[oldest, newest] policy version of any token in the batch."""
        return [min(self.versions), max(self.last_versions or self.versions)] if self.versions else []

    @property
    def swapped(self) -> int:
        """Samples whose tokens came from more than one version."""
        return sum(a != b for a, b in zip(self.versions, self.last_versions))

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def tokens(self) -> int:
        return int(self.loss_mask.sum())


ARRAYS = ("response_ids", "logprobs", "loss_mask", "prompt_ids")


def check(body: dict[str, Any], vocab_size: int) -> str | None:
    """Why a decoded trajectory cannot be trained on, or None."""
    try:
        resp, logp, mask, prompt = (body[name] for name in ARRAYS)
    except KeyError as exc:
        return f"missing field {exc}"
    for name, value in zip(ARRAYS, (resp, logp, mask, prompt)):
        if not isinstance(value, np.ndarray) or value.ndim != 1:
            return f"{name} is not a one-dimensional array"
    for name, ids in (("prompt_ids", prompt), ("response_ids", resp)):
        if ids.dtype.kind not in "iu":
            return f"{name} are {ids.dtype.name}, not integers"
    if logp.dtype.kind != "f":
        return f"logprobs are {logp.dtype.name}, not floats"
    if len(resp) == 0:
        return "empty response"
    if not (len(resp) == len(logp) == len(mask)):
        return f"lengths differ: response {len(resp)}, logprobs {len(logp)}, loss_mask {len(mask)}"
    if len(prompt) == 0:
        return "empty prompt"
    if not np.all(np.isfinite(logp)):
        return "non-finite logprobs"
    if np.any(logp > 1e-4):
        return "logprobs above zero"
    if not np.all((mask == 0) | (mask == 1)):
        return "loss_mask holds values other than 0 and 1"
    if min(prompt.min(), resp.min()) < 0 or max(prompt.max(), resp.max()) >= vocab_size:
        return f"token ids outside the vocabulary [0, {vocab_size})"
    return None


def decode_batch(reply: P.Message, vocab_size: int, temperature: float | None = None
                 ) -> tuple[list[Sample], dict[str, int]]:
    """The batch's samples; trajectories that cannot be trained on are counted by reason and left out. One
    sampled at another temperature than the trainer scales its logits by (`rollout.temperature`) is one."""
    metas = [t for g in reply.header["groups"] for t in g["trajectories"]]
    group_of = {t["id"]: gi for gi, g in enumerate(reply.header["groups"]) for t in g["trajectories"]}
    samples, rejected = [], {}
    for meta, frame in zip(metas, P.split_payloads(metas, reply.payloads)):
        try:
            traj = msgspec.convert(meta, Trajectory, strict=True)
            body = decode_payload(frame)
        except msgspec.ValidationError as exc:  # a broker of this protocol stores none such: say so, go on
            reason = f"metadata: {exc}"
        except Exception as exc:  # a payload that does not decode is one bad trajectory, not a dead trainer
            reason = f"payload does not decode: {exc}"
        else:
            try:
                reason = check(body, vocab_size)
            except Exception as exc:  # a payload that no check foresaw: still one bad trajectory, not a dead trainer
                reason = f"payload not usable: {exc}"
        sampling = body.get("sampling") if reason is None else None
        sampled = sampling.get("temperature") if isinstance(sampling, dict) else None
        if temperature is not None and isinstance(sampled, (int, float)) and abs(sampled - temperature) > 1e-6:
            reason = f"sampled at temperature {sampled}, the trainer assumes {temperature} (rollout.temperature)"
        if reason is not None:
            rejected[reason] = rejected.get(reason, 0) + 1
            log.warning("trajectory_rejected", trajectory=meta.get("id"), reason=reason, explorer=meta.get("explorer"))
            continue
        last = traj.policy_version if traj.last_version is msgspec.UNSET else traj.last_version
        samples.append(Sample(traj.id, group_of[traj.id], traj.reward, traj.policy_version, last,
                              body["prompt_ids"], body["response_ids"], body["logprobs"], body["loss_mask"]))
    return samples, rejected


def build_batch(samples: list[Sample], rejected: dict[str, int], estimator: str, drop_zero_spread: bool,
                pad_id: int) -> Batch | None:
    """Advantages, dropping of uninformative groups, and padding; None if nothing is left to train on."""
    groups = len({s.group for s in samples})
    if not samples:
        return None
    rewards = torch.tensor([s.reward for s in samples])
    gids = torch.tensor([s.group for s in samples])
    tokens = torch.tensor([float(np.count_nonzero(s.loss_mask)) for s in samples])
    adv = advantages(rewards, gids, estimator, tokens=tokens)
    dropped: set[int] = set()
    if drop_zero_spread and group_relative(estimator):
        dropped = zero_spread_groups(rewards, gids)
    keep = [i for i, s in enumerate(samples) if s.group not in dropped]
    if not keep:
        batch = Batch(torch.empty(0, 0, dtype=torch.long), torch.empty(0, 0), torch.empty(0, 0), torch.empty(0, 0),
                     torch.empty(0), torch.empty(0, dtype=torch.long), rewards, [s.policy_version for s in samples],
                      [], rejected, len(dropped), groups, len(samples))
        batch.last_versions = [s.last_version for s in samples]
        return batch
    kept = [samples[i] for i in keep]
    length = max(len(s.prompt_ids) + len(s.response_ids) for s in kept)
    n = len(kept)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros(n, length)
    loss_mask = torch.zeros(n, length - 1)
    behaviour = torch.zeros(n, length - 1)
    for row, s in enumerate(kept):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[row, :p + r] = torch.from_numpy(np.concatenate([s.prompt_ids, s.response_ids]).astype(np.int64))
        attention[row, :p + r] = 1
        # Position j predicts token j + 1: response token k sits at p + k and is predicted at p + k - 1.
        loss_mask[row, p - 1:p - 1 + r] = torch.from_numpy(s.loss_mask.astype(np.float32))
        behaviour[row, p - 1:p - 1 + r] = torch.from_numpy(s.logprobs.astype(np.float32))
    prompt_lens = torch.tensor([len(s.prompt_ids) for s in kept], dtype=torch.long)
    return Batch(input_ids, attention, loss_mask, behaviour, adv[keep], prompt_lens, rewards,
                 [s.policy_version for s in samples],
                 [s.id for s in kept], rejected, len(dropped), groups, len(samples),
                 [s.last_version for s in samples])

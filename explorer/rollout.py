"""Workflows: leased tasks in, scored trajectory groups out.

`single_turn` sends each task's prompt through the chat template, samples
`repeat` responses per task in one engine call, scores each with the
configured reward, and builds one trajectory per response, grouped by task
(the group answers the task's lease). Each trajectory is a (meta, payload)
pair as PUT carries it (docs/protocol.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from common.trajectory import encode_payload
from reward.base import Response, evaluate


@dataclass(slots=True)
class GroupStats:
    rewards: list[float] = field(default_factory=list)
    tokens: int = 0


def build_trajectory(lease: dict[str, Any], index: int, repeat: int, version: int, explorer: str,
                     prompt_ids: list[int], response_ids: list[int], logprobs: list[float], loss_mask: list[int],
                     result, finish_reason: str, text: str, timings: dict[str, float]) -> tuple[dict, bytes]:
    """One trajectory's metadata and payload."""
    if not (len(response_ids) == len(logprobs) == len(loss_mask)):
        raise ValueError(f"response ids, logprobs and loss mask differ in length: "
                         f"{len(response_ids)}, {len(logprobs)}, {len(loss_mask)}")
    meta = {"id": f"{lease['lease_id']}.{index}", "group_id": lease["lease_id"], "task_id": lease["task_id"],
            "group_size": repeat, "batch_index": lease["batch_index"], "policy_version": version,
            "reward": result.score, "n_tokens": len(response_ids), "info": {"finish_reason": finish_reason}}
    payload = encode_payload(
        {"prompt_ids": np.asarray(prompt_ids, dtype=np.int32),
         "response_ids": np.asarray(response_ids, dtype=np.int32),
         "logprobs": np.asarray(logprobs, dtype=np.float32),
         "loss_mask": np.asarray(loss_mask, dtype=np.uint8)},
        {"id": meta["id"], "task_id": lease["task_id"], "group_id": lease["lease_id"], "explorer": explorer,
         "policy_version": version, "reward": result.score, "reward_details": result.details,
         "reward_reason": result.reason, "finish_reason": finish_reason, "text": text, "timings": timings})
    return meta, payload


def single_turn(engine, leases: list[dict[str, Any]], *, repeat: int, temperature: float, top_p: float,
                max_tokens: int, reward_fn: Callable, reward_name: str, explorer: str,
                leased_at: float) -> list[list[tuple[dict, bytes]]]:
    """Roll out and score `leases`; returns one list of trajectories per lease."""
    prompts = [engine.chat_prompt([{"role": "user", "content": lease["task"]["prompt"]}]) for lease in leases]
    version = engine.version
    started = time.monotonic()
    samples = engine.generate(prompts, n=repeat, temperature=temperature, top_p=top_p, max_tokens=max_tokens)
    generated = time.monotonic()
    groups = []
    for lease, prompt_ids, group in zip(leases, prompts, samples):
        scored_at = time.monotonic()
        results = [evaluate(reward_fn, lease["task"], Response(s.text, s.token_ids), name=reward_name) for s in group]
        reward_s = (time.monotonic() - scored_at) / max(1, len(group))
        timings = {"queue_s": round(started - leased_at, 4), "generate_s": round(generated - started, 4),
                   "reward_s": round(reward_s, 6)}
        groups.append([build_trajectory(lease, i, repeat, version, explorer, prompt_ids, s.token_ids, s.logprobs,
                                        [1] * len(s.token_ids), r, s.finish_reason, s.text, timings)
                       for i, (s, r) in enumerate(zip(group, results))])
    return groups

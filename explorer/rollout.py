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

import msgspec
import numpy as np

from rlbus.common.messages import Trajectory
from rlbus.common.trajectory import encode_payload
from rlbus.reward.base import Response, evaluate


def score_all(reward_fn: Callable, tasks: list[dict], responses: list[Response], name: str) -> list:
    """Every response's reward: one batch for remote rewards (reward workers), else one call each."""
    batch = getattr(reward_fn, "score_batch", None)
    if batch is not None:
        return batch(tasks, responses)
    return [evaluate(reward_fn, t, r, name=name) for t, r in zip(tasks, responses)]


def build_trajectory(lease: dict[str, Any], index: int, repeat: int, version: int, explorer: str,
                     prompt_ids: list[int], response_ids: list[int], logprobs: list[float], loss_mask: list[int],
                     result, finish_reason: str, text: str, timings: dict[str, float],
                     sampling: dict[str, float] | None = None) -> tuple[dict, bytes]:
    """One trajectory's metadata and payload (with the sampling settings its logprobs were taken under)."""
    if not (len(response_ids) == len(logprobs) == len(loss_mask)):
        raise ValueError(f"response ids, logprobs and loss mask differ in length: "
                         f"{len(response_ids)}, {len(logprobs)}, {len(loss_mask)}")
    tid = f"{lease['lease_id']}.{index}"
    payload = encode_payload(
        {"prompt_ids": np.asarray(prompt_ids, dtype=np.int32),
         "response_ids": np.asarray(response_ids, dtype=np.int32),
         "logprobs": np.asarray(logprobs, dtype=np.float32),
         "loss_mask": np.asarray(loss_mask, dtype=np.uint8)},
        {"id": tid, "task_id": lease["task_id"], "group_id": lease["lease_id"], "explorer": explorer,
         "policy_version": version, "reward": result.score, "reward_details": result.details,
         "reward_reason": result.reason, "finish_reason": finish_reason, "text": text, "timings": timings,
         **({"sampling": sampling} if sampling else {})})
    meta = Trajectory(id=tid, group_id=lease["lease_id"], task_id=lease["task_id"], group_size=repeat,
                      batch_index=lease["batch_index"], policy_version=version, reward=result.score,
                      n_tokens=len(response_ids), payload_bytes=len(payload), info={"finish_reason": finish_reason})
    return msgspec.to_builtins(meta), payload


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
    scored_at = time.monotonic()
    all_results = score_all(reward_fn, [lease["task"] for lease in leases for _ in range(repeat)],
                            [Response(s.text, s.token_ids) for group in samples for s in group], reward_name)
    reward_s = (time.monotonic() - scored_at) / max(1, len(all_results))
    for k, (lease, prompt_ids, group) in enumerate(zip(leases, prompts, samples)):
        results = all_results[k * repeat:(k + 1) * repeat]
        timings = {"queue_s": round(started - leased_at, 4), "generate_s": round(generated - started, 4),
                   "reward_s": round(reward_s, 6)}
        groups.append([build_trajectory(lease, i, repeat, version, explorer, prompt_ids, s.token_ids, s.logprobs,
                                        [1] * len(s.token_ids), r, s.finish_reason, s.text, timings,
                                        {"temperature": temperature, "top_p": top_p})
                       for i, (s, r) in enumerate(zip(group, results))])
    return groups


@dataclass(slots=True)
class _Episode:
    lease: dict[str, Any]
    index: int
    prompt_ids: list[int]
    env: Any
    messages: list[dict[str, str]]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)
    finish_reason: str = ""
    done: bool = False


def _env_tokens(engine, messages: list[dict[str, str]], reply: str, ended_with_eos: bool, answer: str) -> list[int]:
    """Tokens the chat template puts between the model's reply and its next turn, the environment's words included."""
    before = messages + [{"role": "assistant", "content": reply}]
    after = before + [{"role": "user", "content": answer}]
    text_before = engine.tokenizer.apply_chat_template(before, tokenize=False)
    text_after = engine.tokenizer.apply_chat_template(after, tokenize=False, add_generation_prompt=True)
    if not text_after.startswith(text_before):
        raise ValueError("the chat template does not extend a conversation by appending; multi-turn needs it")
    closing = text_before[text_before.rindex(reply) + len(reply):] if reply else ""
    eos = engine.tokenizer.eos_token or ""
    if ended_with_eos and eos and closing.startswith(eos):
        closing = closing[len(eos):]  # the model already produced it
    return list(engine.tokenizer.encode(closing + text_after[len(text_before):], add_special_tokens=False))


def multi_turn(engine, leases: list[dict[str, Any]], make_env: Callable, *, repeat: int, temperature: float,
               top_p: float, max_tokens: int, reward_fn: Callable, reward_name: str, explorer: str,
               leased_at: float) -> list[list[tuple[dict, bytes]]]:
    """Episodes of model turns and environment answers, `repeat` per lease.

    The trajectory's response is everything after the first prompt: the
    model's tokens (loss mask 1, with their behaviour logprobs) and the
    environment's (mask 0, logprob 0), exactly as the model saw them.
    """
    version = engine.version
    started = time.monotonic()
    episodes = []
    for lease in leases:
        messages = [{"role": "user", "content": lease["task"]["prompt"]}]
        prompt_ids = engine.chat_prompt(messages)
        episodes += [_Episode(lease, i, prompt_ids, make_env(lease["task"]), list(messages)) for i in range(repeat)]
    eos_id = engine.tokenizer.eos_token_id
    while active := [e for e in episodes if not e.done]:
        outs = engine.generate([e.prompt_ids + e.response_ids for e in active], n=1, temperature=temperature,
                               top_p=top_p, max_tokens=max_tokens)
        for episode, (sample,) in zip(active, outs):
            episode.response_ids += sample.token_ids
            episode.logprobs += sample.logprobs
            episode.loss_mask += [1] * len(sample.token_ids)
            episode.turns.append(sample.text)
            episode.finish_reason = sample.finish_reason
            answer, episode.done = episode.env.step(sample.text)
            if not episode.done:
                ended = bool(sample.token_ids) and sample.token_ids[-1] == eos_id
                env_ids = _env_tokens(engine, episode.messages, sample.text, ended, answer)
                episode.messages += [{"role": "assistant", "content": sample.text}, {"role": "user", "content": answer}]
                episode.response_ids += env_ids
                episode.logprobs += [0.0] * len(env_ids)
                episode.loss_mask += [0] * len(env_ids)
    generated = time.monotonic()
    groups: dict[str, list[tuple[dict, bytes]]] = {}
    results = score_all(reward_fn, [e.lease["task"] for e in episodes],
                        [Response(e.turns[-1], [t for t, m in zip(e.response_ids, e.loss_mask) if m], tuple(e.turns))
                         for e in episodes], reward_name)
    for e, result in zip(episodes, results):
        timings = {"queue_s": round(started - leased_at, 4), "generate_s": round(generated - started, 4),
                   "reward_s": 0.0}
        groups.setdefault(e.lease["lease_id"], []).append(build_trajectory(
            e.lease, e.index, repeat, version, explorer, e.prompt_ids, e.response_ids, e.logprobs, e.loss_mask,
            result, e.finish_reason, "\n".join(e.turns), timings, {"temperature": temperature, "top_p": top_p}))
    return [groups[lease["lease_id"]] for lease in leases]

"""Workflows: leased tasks in, scored trajectory groups out.

`Rollouts` keeps leased tasks in flight in the engine. `add` submits each
task's prompt (through the chat template); every `step` advances the
engine one step and returns the groups that step completed, scored and
built, one trajectory per sample, grouped by task (the group answers the
task's lease). A task without an environment is one request of `repeat`
samples. A task with one (`env` in the task) runs `repeat` episodes of model
turns and environment answers, each turn a request of its own submitted as
the previous one ends. The explorer adds tasks as slots free up (streaming)
or a batch at a time (`roll_out`). Each trajectory is a (meta, payload) pair
as PUT carries it (docs/protocol.md), with the policy version of every run
of its tokens: a weight swap while a sample is in flight splits it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import numpy as np
import structlog

from rlbus.common.messages import Trajectory
from rlbus.common.trajectory import encode_payload
from rlbus.explorer.engine import without_chat_template
from rlbus.reward.base import Response, evaluate

log = structlog.get_logger()


def score_all(reward_fn: Callable, tasks: list[dict], responses: list[Response], name: str) -> list:
    """Every response's reward: one batch for remote rewards (reward workers), else one call each."""
    batch = getattr(reward_fn, "score_batch", None)
    if batch is not None:
        return batch(tasks, responses)
    return [evaluate(reward_fn, t, r, name=name) for t, r in zip(tasks, responses)]


def build_trajectory(lease: dict[str, Any], index: int, repeat: int, versions: list[tuple[int, int]],
                     explorer: str, prompt_ids: list[int], response_ids: list[int], logprobs: list[float],
                     loss_mask: list[int], result, finish_reason: str, text: str, timings: dict[str, float],
                     sampling: dict[str, float] | None = None) -> tuple[dict, bytes]:
    """One trajectory's metadata and payload (with the sampling settings its logprobs were taken under).

    `versions` lists (first response index, policy version) for each run of tokens one version sampled, in
    order; `policy_version` is the oldest (the one staleness counts from), `last_version` the newest."""
    if not (len(response_ids) == len(logprobs) == len(loss_mask)):
        raise ValueError(f"response ids, logprobs and loss mask differ in length: "
                         f"{len(response_ids)}, {len(logprobs)}, {len(loss_mask)}")
    if not versions:
        raise ValueError("a trajectory needs the policy version of its tokens")
    version, last = versions[0][1], versions[-1][1]
    tid = f"{lease['lease_id']}.{index}"
    payload = encode_payload(
        {"prompt_ids": np.asarray(prompt_ids, dtype=np.int32),
         "response_ids": np.asarray(response_ids, dtype=np.int32),
         "logprobs": np.asarray(logprobs, dtype=np.float32),
         "loss_mask": np.asarray(loss_mask, dtype=np.uint8)},
        {"id": tid, "task_id": lease["task_id"], "group_id": lease["lease_id"], "explorer": explorer,
         "policy_version": version, "last_version": last, "versions": [list(v) for v in versions],
         "reward": result.score, "reward_details": result.details,
         "reward_reason": result.reason, "finish_reason": finish_reason, "text": text, "timings": timings,
         **({"sampling": sampling} if sampling else {})})
    meta = Trajectory(id=tid, group_id=lease["lease_id"], task_id=lease["task_id"], group_size=repeat,
                      batch_index=lease["batch_index"], policy_version=version, last_version=last,
                      reward=result.score,
                      n_tokens=len(response_ids), payload_bytes=len(payload), info={"finish_reason": finish_reason})
    return msgspec.to_builtins(meta), payload


@dataclass(slots=True)
class _Episode:
    """One sample of a group: a single response, or the turns of an episode with an environment."""

    group: "_Group"
    index: int
    env: Any = None
    messages: list[dict[str, str]] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[tuple[int, int]] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)
    finish_reason: str = ""
    done: bool = False

    def add_turn(self, sample) -> None:
        """The model's tokens of one turn (loss mask 1, with their behaviour logprobs and versions)."""
        offset = len(self.response_ids)
        for start, version in sample.versions:
            if not self.versions or self.versions[-1][1] != version:
                self.versions.append((offset + start, version))
        self.response_ids += sample.token_ids
        self.logprobs += sample.logprobs
        self.loss_mask += [1] * len(sample.token_ids)
        self.turns.append(sample.text)
        self.finish_reason = sample.finish_reason


@dataclass(slots=True)
class _Group:
    lease: dict[str, Any]
    prompt_ids: list[int]
    leased_at: float
    submitted: float
    version: int  # the engine's when submitted: the version of a sample that has no tokens
    episodes: list[_Episode] = field(default_factory=list)


class Rollouts:
    """Leased tasks in flight in one engine (see the module docstring)."""

    def __init__(self, engine, *, repeat: int, temperature: float, top_p: float, max_tokens: int,
                 reward_fn: Callable, reward_name: str, explorer: str, make_env: Callable | None = None):
        self.engine = engine
        self.repeat, self.temperature, self.top_p, self.max_tokens = repeat, temperature, top_p, max_tokens
        self.reward_fn, self.reward_name, self.explorer, self.make_env = reward_fn, reward_name, explorer, make_env
        self.groups: dict[str, _Group] = {}
        self._requests: dict[str, list[_Episode]] = {}  # engine request id -> the episodes it samples for
        self._turns = itertools.count()
        self.generate_s: list[float] = []  # of each group the last step completed: submitted to done
        self._cut_said = False  # whether a prompt left less room than max_tokens was warned about

    @property
    def tasks(self) -> int:
        """Tasks in flight."""
        return len(self.groups)

    def add(self, leases: list[dict[str, Any]], leased_at: float) -> None:
        for lease in leases:
            messages = [{"role": "user", "content": lease["task"]["prompt"]}]
            group = _Group(lease, self.engine.chat_prompt(messages), leased_at, time.monotonic(), self.engine.version)
            self.groups[lease["lease_id"]] = group
            if "env" in lease["task"]:
                if self.make_env is None:
                    raise ValueError(f"task {lease['task_id']} has an environment and this workflow none")
                if without_chat_template(self.engine.tokenizer):
                    raise ValueError(f"task {lease['task_id']} is multi-turn, which puts the environment's words "
                                     f"into the conversation through the model's chat template; this model has none")
                group.episodes = [_Episode(group, i, self.make_env(lease["task"]), list(messages))
                                  for i in range(self.repeat)]
                for episode in group.episodes:
                    self._submit([episode], group.prompt_ids)
            else:
                group.episodes = [_Episode(group, i) for i in range(self.repeat)]
                self._submit(group.episodes, group.prompt_ids)

    def _submit(self, episodes: list[_Episode], prompt: list[int]) -> None:
        task = episodes[0].group.lease["task_id"]
        room = room_after(self.engine, prompt, task)
        if room < self.max_tokens and not self._cut_said:
            self._cut_said = True  # once for the tasks rolled out together: every sample of such a task ends there
            log.warning("responses_cut_by_the_context", task_id=task, prompt_tokens=len(prompt),
                        max_tokens=self.max_tokens, max_model_len=self.engine.max_model_len,
                        hint=f"responses to this prompt end after {room} tokens, not rollout.max_tokens: raise "
                             f"explorer.max_model_len (within the model's context) or lower rollout.max_tokens")
        rid = f"{episodes[0].group.lease['lease_id']}/{next(self._turns)}"
        self.engine.submit(rid, prompt, n=len(episodes), temperature=self.temperature, top_p=self.top_p,
                           max_tokens=self.max_tokens)
        self._requests[rid] = episodes

    def step(self) -> list[list[tuple[dict, bytes]]]:
        """One engine step; returns the groups it completed (all their samples done), scored and built."""
        finished: list[_Group] = []
        for rid, samples in self.engine.step().items():
            episodes = self._requests.pop(rid)
            for episode, sample in zip(episodes, samples):
                episode.add_turn(sample)
                self._next_turn(episode, sample)
            group = episodes[0].group
            if all(e.done for e in group.episodes):
                finished.append(self.groups.pop(group.lease["lease_id"]))
        now = time.monotonic()
        self.generate_s = [now - group.submitted for group in finished]
        return [self._build(group) for group in finished]

    def _next_turn(self, episode: _Episode, sample) -> None:
        if episode.env is None:
            episode.done = True
            return
        answer, episode.done = episode.env.step(sample.text)
        if episode.done:
            return
        ended = bool(sample.token_ids) and sample.token_ids[-1] == self.engine.tokenizer.eos_token_id
        env_ids = _env_tokens(self.engine, episode.messages, sample.text, ended, answer)
        episode.messages += [{"role": "assistant", "content": sample.text}, {"role": "user", "content": answer}]
        episode.response_ids += env_ids  # the environment's words, as the model sees them: mask 0, logprob 0
        episode.logprobs += [0.0] * len(env_ids)
        episode.loss_mask += [0] * len(env_ids)
        conversation = episode.group.prompt_ids + episode.response_ids
        if len(conversation) >= self.engine.max_model_len:  # no room for another turn: the episode ends here
            episode.done = True
            return
        self._submit([episode], conversation)

    def _build(self, group: _Group) -> list[tuple[dict, bytes]]:
        generated = time.monotonic()
        task = group.lease["task"]
        multi = any(e.env is not None for e in group.episodes)
        responses = [Response(e.turns[-1], [t for t, m in zip(e.response_ids, e.loss_mask) if m],
                              tuple(e.turns) if multi else ()) for e in group.episodes]
        results = score_all(self.reward_fn, [task] * len(responses), responses, self.reward_name)
        timings = {"queue_s": round(group.submitted - group.leased_at, 4),
                   "generate_s": round(generated - group.submitted, 4),
                   "reward_s": round((time.monotonic() - generated) / max(1, len(results)), 6)}
        sampling = {"temperature": self.temperature, "top_p": self.top_p}
        return [build_trajectory(group.lease, e.index, self.repeat, e.versions or [(0, group.version)],
                                 self.explorer, group.prompt_ids, e.response_ids, e.logprobs, e.loss_mask, result,
                                 e.finish_reason, "\n".join(e.turns), timings, sampling)
                for e, result in zip(group.episodes, results)]


def context_tokens(max_model_len: int, max_tokens: int, model_context: int | None = None) -> int:
    """The engine's max_model_len: `explorer.max_model_len`, else (0) room for `rollout.max_tokens` after a prompt
    of 512 tokens, and never less than 1024, nor more than the model's own context (`model_context`)."""
    if max_model_len:
        return max_model_len
    wanted = max(1024, max_tokens + 512)
    return min(wanted, model_context) if model_context else wanted


class PromptTooLong(ValueError):
    """A task's prompt that leaves the engine no room for a response."""


def room_after(engine, prompt: list[int], task_id: Any) -> int:
    """Tokens the engine can generate after `prompt`; PromptTooLong, naming the task and the setting, if none."""
    room = engine.max_model_len - len(prompt)
    if room < 1:
        raise PromptTooLong(f"task {task_id!r}: its prompt is {len(prompt)} tokens and the engine holds "
                            f"{engine.max_model_len} a sample (explorer.max_model_len): raise that, or shorten "
                            f"the task's prompt")
    return room


def roll_out(engine, leases: list[dict[str, Any]], **kw) -> list[list[tuple[dict, bytes]]]:
    """Roll out and score `leases` together; returns one list of trajectories per lease, in order. `kw` are
    `Rollouts`' settings (with `leased_at`)."""
    leased_at = kw.pop("leased_at", time.monotonic())
    rollouts = Rollouts(engine, **kw)
    rollouts.add(leases, leased_at)
    built: dict[str, list[tuple[dict, bytes]]] = {}
    while rollouts.tasks:
        for group in rollouts.step():
            built[group[0][0]["group_id"]] = group
    return [built[lease["lease_id"]] for lease in leases]


def greedy_accuracy(engine, tasks: list[dict[str, Any]], reward_fn: Callable, max_tokens: int, name: str) -> float:
    """The share of `tasks` whose greedy answer scores 1 or more (held-out evaluation), scored as rollouts are."""
    prompts = [engine.chat_prompt([{"role": "user", "content": t["prompt"]}]) for t in tasks]
    for task, prompt in zip(tasks, prompts):
        room_after(engine, prompt, task.get("task_id"))
    outs = engine.generate(prompts, n=1, temperature=0.0, max_tokens=max_tokens)
    results = score_all(reward_fn, tasks, [Response(o[0].text, o[0].token_ids) for o in outs], name)
    return sum(1 for r in results if r.score >= 1.0) / len(results)


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

"""Reward models: a scalar score per (prompt, response) from an HF sequence classifier, in batches.

`RewardModel(path).score(prompts, responses)` puts each pair through the
model's chat template (user, assistant) when it has one, pads a batch at a
time, and returns the first logit of each. As a reward plugin (`rm`, with
`params: {path: ...}`) it scores one response per call; reward workers call
`score` on whole batches.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Mapping, Sequence

from rlbus.reward.base import Response, RewardResult, register


class RewardModel:
    def __init__(self, path: str, batch_size: int = 16, device: str = "cpu", max_length: int = 1024):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size, self.device, self.max_length = batch_size, device, max_length
        self._torch = torch

    def _text(self, prompt: str, response: str) -> str:
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False)
        return f"{prompt}\n{response}"

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        texts = [self._text(p, r) for p, r in zip(prompts, responses, strict=True)]
        out: list[float] = []
        with self._torch.no_grad():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[i:i + self.batch_size], return_tensors="pt", padding=True,
                                     truncation=True, max_length=self.max_length).to(self.device)
                out.extend(self.model(**enc).logits[:, 0].float().tolist())
        return out


@lru_cache(maxsize=4)
def _load(path: str) -> RewardModel:
    return RewardModel(path)


@register("rm")
def reward_model(task: Mapping[str, Any], response: Response, path: str = "") -> RewardResult:
    if not path:
        return RewardResult(0.0, {}, "the rm reward needs params.path (a sequence-classification model directory)")
    score = _load(path).score([task.get("prompt", "")], [response.text])[0]
    return RewardResult(score, {"model": path}, "" if score else "the reward model scored exactly 0")

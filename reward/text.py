"""Rewards on the shape of the text: format, exact match, length penalty.

Parameters come from config (`reward.terms[].params`) as keyword arguments:

- `format`: `pattern` (a regex the whole response must match) or `tags`
  (each `<tag>...</tag>` pair must appear, in order);
- `exact`: the stripped response equals the answer (`ignore_case`);
- `length_penalty`: 0 up to `max_tokens` response tokens, then -`per_token`
  for each token beyond, down to -1.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from rlbus.reward.base import Response, RewardResult, register


@register("format")
def format_reward(task: Mapping[str, Any], response: Response, pattern: str = "", tags: tuple[str, ...] = ()
                  ) -> RewardResult:
    text = response.text.strip()
    if pattern:
        if re.fullmatch(pattern, text, flags=re.DOTALL):
            return RewardResult(1.0)
        return RewardResult(0.0, {"pattern": pattern}, "response does not match the required format")
    position = 0
    for tag in ((tags,) if isinstance(tags, str) else tags) or ("think", "answer"):  # `tags: answer` is one tag
        t = re.escape(tag)  # a tag is a name, never a pattern
        found = re.compile(rf"<{t}>.*?</{t}>", re.DOTALL).search(text, position)
        if found is None:
            return RewardResult(0.0, {"missing": tag}, f"no <{tag}>...</{tag}> where expected")
        position = found.end()
    return RewardResult(1.0)


@register("exact")
def exact_match(task: Mapping[str, Any], response: Response, ignore_case: bool = False) -> RewardResult:
    got, want = response.text.strip(), str(task["answer"]).strip()
    if ignore_case:
        got, want = got.lower(), want.lower()
    if got == want:
        return RewardResult(1.0)
    return RewardResult(0.0, {"got": got[:100]}, "response is not exactly the answer")


@register("length_penalty")
def length_penalty(task: Mapping[str, Any], response: Response, max_tokens: int = 256, per_token: float = 0.01
                   ) -> RewardResult:
    over = max(0, len(response.token_ids) - max_tokens)
    if not over:
        return RewardResult(0.0, {"over": 0}, f"no penalty: within {max_tokens} tokens")
    return RewardResult(-min(1.0, over * per_token), {"over": over}, f"{over} tokens over {max_tokens}")

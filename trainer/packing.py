"""Shared-prompt training: a micro-batch as one packed sequence in which every prompt is computed once.

In a GRPO step all samples of a group share their prompt, and on the
default job all groups share the model's system prompt: per sample the
trainer would run forward and backward over ~44 prompt tokens to train ~11
response tokens. Packed, the micro-batch becomes one sequence laid out as a
tree:

    [prefix common to every prompt] [rest of prompt 1] [response 1a] [response 1b] ... [rest of prompt 2] ...

with position ids that restart where each branch leaves its parent, and an
attention mask under which a token sees its own segment up to itself and
every segment on its path to the root, nothing else. Each token so attends
to exactly the tokens, at exactly the positions, it has in its own padded
row: the log-probabilities and, since a shared prompt token's gradient is
the sum of what each response sends back through it, the gradients are
those of the per-sample path, up to floating-point summation order.

`pack` builds the layout; `packed_token_logprobs` returns the same
[B, T-1] tensors as `rlbus.trainer.model.token_logprobs` on the padded rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlbus.trainer.model import logprobs_at


@dataclass
class Packed:
    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N]
    allowed: torch.Tensor  # [N, N] bool: query i may attend to key j
    predictor: torch.Tensor  # [B, T-1] long: packed index whose output predicts row token j + 1 (-1: none)

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])


def _common_prefix(prompts: list[tuple[int, ...]]) -> int:
    if len(prompts) < 2:
        return len(prompts[0]) if prompts else 0
    first, length = prompts[0], min(len(p) for p in prompts)
    for i in range(length):
        if any(p[i] != first[i] for p in prompts[1:]):
            return i
    return length


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lens: torch.Tensor) -> Packed:
    """The packed layout of right-padded rows `input_ids` [B, T] whose first `prompt_lens[b]` tokens are the
    prompt; rows with equal prompts share them, and all prompts share their common prefix."""
    rows, width = input_ids.shape
    lengths = attention_mask.sum(1).long().tolist()
    plens = prompt_lens.long().tolist()
    ids = input_ids.tolist()
    prompts: dict[tuple[int, ...], list[int]] = {}
    for b in range(rows):
        if not 1 <= plens[b] <= lengths[b]:
            raise ValueError(f"row {b}: prompt length {plens[b]} outside [1, {lengths[b]}]")
        prompts.setdefault(tuple(ids[b][:plens[b]]), []).append(b)
    shared = _common_prefix(list(prompts))
    tokens: list[int] = []
    positions: list[int] = []
    segment: list[int] = []  # segment id of each packed token
    parents: list[list[int]] = []  # each segment's ancestors (root first)
    predictor = torch.full((rows, width - 1), -1, dtype=torch.long)

    def add(seq: list[int], start_pos: int, ancestors: list[int]) -> int:
        seg = len(parents)
        parents.append(ancestors)
        first = len(tokens)
        tokens.extend(seq)
        positions.extend(range(start_pos, start_pos + len(seq)))
        segment.extend([seg] * len(seq))
        return first

    any_prompt = next(iter(prompts))
    root_at = add(list(any_prompt[:shared]), 0, [])
    for prompt, members in prompts.items():
        rest_at = add(list(prompt[shared:]), shared, [0])
        prompt_segment = len(parents) - 1
        # The packed index of each prompt token (shared prefix, then this prompt's rest).
        prompt_index = list(range(root_at, root_at + shared)) + list(range(rest_at, rest_at + len(prompt) - shared))
        for b in members:
            p, n = plens[b], lengths[b]
            resp_at = add(ids[b][p:n], p, [0, prompt_segment])
            # Row position j predicts row token j + 1; the row's token j sits at packed index `index(j)`.
            for j in range(p - 1, n - 1):
                predictor[b, j] = prompt_index[j] if j < p else resp_at + (j - p)
    seg = torch.tensor(segment)
    ancestor = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for s, ancestors in enumerate(parents):
        ancestor[s, ancestors] = True
    order = torch.arange(len(tokens))
    allowed = ((seg[:, None] == seg[None, :]) & (order[None, :] <= order[:, None])) | ancestor[seg[:, None], seg[None, :]]
    return Packed(torch.tensor([tokens]), torch.tensor([positions]), allowed, predictor)


def packs(model) -> bool:
    """Whether the model's attention takes the custom [1, 1, N, N] mask packing needs (SDPA and eager do;
    flash-attention kernels and flex attention's block masks do not)."""
    return getattr(model.config, "_attn_implementation", None) in ("sdpa", "eager")


def attention_mask_for(model, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The [1, 1, N, N] mask in the form the model's attention takes: boolean for SDPA and flex, additive
    (0 or the dtype's minimum) for eager attention."""
    mask = allowed[None, None]
    if getattr(model.config, "_attn_implementation", "sdpa") == "eager":
        return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


def packed_token_logprobs(model, packed: Packed, input_ids: torch.Tensor, temperature: float = 1.0,
                          with_entropy: bool = False, positions: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` of the padded rows `input_ids` [B, T], computed on their packed layout."""
    device = next(model.parameters()).device
    decoder = model.get_decoder()
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else model.dtype
    mask = attention_mask_for(model, packed.allowed, dtype).to(device)
    hidden = decoder(input_ids=packed.input_ids.to(device), position_ids=packed.position_ids.to(device),
                     attention_mask=mask).last_hidden_state[0]
    targets = input_ids[:, 1:].to(device)
    predictor = packed.predictor.to(device)
    where = predictor >= 0
    if positions is not None:
        where &= positions.to(device).bool()
    return logprobs_at(model, hidden[predictor[where]], targets, where, temperature, with_entropy)

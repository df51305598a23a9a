"""The policy being trained: model, optimizer and schedule, the optimizer steps on a batch, training checkpoints.

A `Learner` knows nothing of the broker: `rlbus trainer` feeds it batches
(trainer/main.py) and `rlbus replay` feeds it a run's recorded ones. A
trainer step takes one optimizer step on its batch, or `algorithm.epochs` ×
`algorithm.mini_batches` (PPO's update loop); each runs over micro-batches
with gradient accumulation. Every forward goes through a `Policy`
(trainer/distributed.py), the model's root FSDP2 unit when the trainer is
sharded, where each rank trains its share of the micro-batches and the
metrics are summed across ranks.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from functools import partial
from pathlib import Path

import structlog
import torch

from rlbus.common import protocol as P
from rlbus.common.config import ConfigError, RunConfig
from rlbus.common.cores import CoreWait
from rlbus.trainer import checkpoint, distributed
from rlbus.trainer.algorithms import LossConfig, lr_factor, policy_loss
from rlbus.trainer.batch import Batch, build_batch, decode_batch
from rlbus.trainer.distributed import Policy, World
from rlbus.trainer.model import autocast_dtype, frozen_in, load_model, seed_everything, token_logprobs
from rlbus.trainer.packing import packed_token_logprobs, pack, packs

log = structlog.get_logger()


def usable_device(name: str) -> torch.device:
    """`trainer.device` as torch takes it, where this process can compute on it; else ConfigError naming it."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"trainer.device={name!r} is no torch device (cpu, cuda, cuda:1, ...)") from None
    backend = getattr(torch, device.type, None) if device.type != "cpu" else None
    if backend is not None and not (hasattr(backend, "is_available") and backend.is_available()):
        raise ConfigError(f"trainer.device={name!r}: this torch ({torch.__version__}) has no {device.type} device "
                          f"here; use cpu, or install the GPU build (make ENGINE=gpu)")
    count = backend.device_count() if backend is not None and hasattr(backend, "device_count") else None
    if device.index is not None and count is not None and device.index >= count:
        raise ConfigError(f"trainer.device={name!r}: this host has {count} {device.type} device(s), "
                          f"numbered from 0")
    return device


class Learner:
    """The policy being trained and the optimizer steps on a batch, on one process or on this rank of several."""

    def __init__(self, cfg: RunConfig, model_path: str, world: World | None = None):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.world = world
        self.main = world is None or world.main
        t, a = cfg.trainer, cfg.algorithm
        self.device = world.device if world else usable_device(t.device)
        self.autocast = autocast_dtype(t.autocast, self.device)
        # What it resolved to, by name (as trainer.autocast takes it): logged for auto, recorded for replay.
        self.autocast_name = str(self.autocast).removeprefix("torch.") if self.autocast else "off"
        if t.autocast == "auto" and self.main:
            log.info("trainer_autocast", device=str(self.device), dtype=self.autocast_name)
        if t.threads:
            torch.set_num_threads(t.threads)
        elif world and self.device.type == "cpu":  # the cores this process may use, shared among the host's ranks
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world.size))
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local))
        # logged with each step; on a GPU its CPU threads are not where the step's work is
        self.core_wait = CoreWait("trainer.threads", torch.get_num_threads() if self.device.type == "cpu" else 1)
        if t.deterministic:
            # cuBLAS reads this when CUDA starts; without it deterministic algorithms refuse its GEMMs
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.model_path = model_path
        seed_everything(cfg.rollout.seed)
        # Sharded, each rank loads the model on the CPU and keeps only its shards on its device.
        load_on = "cpu" if world else str(self.device)
        self.model = load_model(model_path, cfg, device=load_on)
        self.reference = load_model(model_path, cfg, trainable=False, device=load_on) if a.kl_coef > 0 else None
        tok = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        self.vocab = self.model.config.vocab_size
        self.shared_prompt = t.shared_prompt and packs(self.model)
        if t.shared_prompt and not self.shared_prompt and self.main:
            log.warning("shared_prompt_unavailable", attention=self.model.config._attn_implementation,
                        note="this attention takes no custom mask: one row per sample")
        if self.shared_prompt and self.device.type == "cpu":
            # On CPUs SDPA's kernel gains nothing from a custom mask; plain attention is faster there
            # (packed default-task step, SmolLM2-135M, 2 cores: 3.6 s against 4.65 s, median of 5).
            for model in (self.model, self.reference):
                if model is not None:
                    model.set_attn_implementation("eager")
        elif t.deterministic and self.device.type == "cuda":
            # SDPA's fused CUDA kernels (memory-efficient, flash) sum gradients in no fixed order, and torch only
            # warns about it under warn_only: plain attention keeps a replay's weights equal bit for bit.
            self.model.set_attn_implementation("eager")
        if self.reference is not None and world is None:
            frozen_in(self.reference, self.autocast)  # its linear weights cast once, not at every step
        # Every forward goes through a Policy: the root FSDP2 unit when sharded, a plain call otherwise.
        self.policy = distributed.shard(self.model, world) if world else Policy(self.model)
        self.reference_policy = None
        if self.reference is not None:
            self.reference_policy = distributed.shard(self.reference, world) if world else Policy(self.reference)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay,
                                           **self._adamw_kernel())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, partial(lr_factor, t))
        self.loss_cfg = LossConfig(a.clip_low, a.clip_high, a.dual_clip, a.is_mode, a.is_cap, a.is_low, a.is_high,
                                   a.kl_coef, a.kl_kind, a.kl_clamp, a.aggregation, cfg.rollout.max_tokens,
                                   a.ratio_level)
        self.ckpt_dir = Path(cfg.run.dir) / "checkpoints"
        self.step = 0
        self.version = 0
        self.temperature = cfg.rollout.temperature or 1.0

    def _adamw_kernel(self) -> dict[str, bool | None]:
        return {"fused": bool(self.cfg.trainer.fused_optimizer) or None, "foreach": None}  # None: torch's default

    def resume(self) -> None:
        path = checkpoint.latest(self.ckpt_dir)
        if path is None:
            return
        try:
            step, version = checkpoint.load(path, self.model, self.optimizer, self.scheduler,
                                            sharded=self.world is not None)
        except checkpoint.CheckpointMismatch as exc:
            record = checkpoint.read_record(self.cfg.run.dir) or {}
            trained = f" ({record['model_path']}, says trainer.json)" if "model_path" in record else ""
            raise ConfigError(f"cannot resume from {path}: {exc}. run.dir {self.cfg.run.dir} holds a run of another "
                              f"model{trained}: give a new run.dir, or that run's model.path") from None
        for group in self.optimizer.param_groups:  # the checkpoint's groups name the kernel they ran: this config's
            group.update(self._adamw_kernel())
        self.step, self.version = step + 1, version
        if self.main:
            log.info("trainer_resumed", checkpoint=str(path), step=self.step, policy_version=version)

    def _autocast(self):
        """Mixed precision for the forward pass (weights and optimizer stay in `model.dtype`)."""
        return torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16,
                              enabled=self.autocast is not None)

    def train_on(self, batch: Batch, skipped: int = 0) -> dict[str, float]:
        """`algorithm.epochs` passes over the batch, each one optimizer step per mini-batch
        (`algorithm.mini_batches`), every step in micro-batches; returns metrics. `skipped`: samples of
        all-equal groups the broker left out of the batch (for `algorithm.loss_denominator: batch`)."""
        a = self.cfg.algorithm
        step = -(-batch.size // min(a.mini_batches, batch.size))
        parts = [range(lo, min(lo + step, batch.size)) for lo in range(0, batch.size, step)]
        # One update: the proximal policy is the current one, detached. Several: the policy before the first.
        prox = self._proximal(batch, parts) if a.epochs * len(parts) > 1 else None
        sums: Counter[str] = Counter()
        norms = [self._update(batch, part, prox, skipped, sums) for _ in range(a.epochs) for part in parts]
        self.scheduler.step()  # the schedule runs in trainer steps, however many updates a batch takes
        n = max(1, batch.tokens * a.epochs)
        out = {k: v / n for k, v in sums.items() if k not in ("loss", "forward_tokens")}
        out.update(loss=sums["loss"] / len(norms), grad_norm=sum(norms) / len(norms),
                   lr=self.scheduler.get_last_lr()[0], forward_tokens=int(sums["forward_tokens"]))
        return out

    def _micro(self, batch: Batch, part: range):
        """This rank's micro-batches of a mini-batch: (slice, counts). A rank with fewer than the others gets
        (the first one, False): a pass that only keeps the ranks' collectives in step, with weight 0."""
        mb = self.cfg.trainer.micro_batch
        for index in distributed.micro_batches(-(-len(part) // mb), self.world):
            start = part.start + (index * mb if index is not None else 0)
            yield slice(start, min(start + mb, part.stop)), index is not None

    def _logprobs(self, batch: Batch, sl: slice):
        """The forward of a micro-batch, as `policy(fn, ...)` takes it, and the tokens it forwards."""
        ids, att = batch.input_ids[sl].to(self.device), batch.attention_mask[sl].to(self.device)
        if self.shared_prompt:
            packed = pack(batch.input_ids[sl], batch.attention_mask[sl], batch.prompt_lens[sl])
            return partial(packed_token_logprobs, packed=packed, input_ids=ids), packed.tokens
        return partial(token_logprobs, input_ids=ids, attention_mask=att), int(att.sum())

    @torch.no_grad()
    def _proximal(self, batch: Batch, parts: list[range]) -> torch.Tensor:
        """Every sample's logprobs under the policy before this batch's first update (the micro-batches this
        rank trains; zero elsewhere): the proximal policy of every update on the batch."""
        prox = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        for part in parts:
            for sl, counts in self._micro(batch, part):
                logprobs, _ = self._logprobs(batch, sl)
                with self._autocast():
                    logp, _ = self.policy(logprobs, temperature=self.temperature,
                                          positions=batch.loss_mask[sl].to(self.device))
                if counts:
                    prox[sl] = logp.float().cpu()
        return prox

    def _update(self, batch: Batch, part: range, prox: torch.Tensor | None, skipped: int, sums: Counter) -> float:
        """One optimizer step on the mini-batch `part`, its loss that of the mini-batch alone; adds to `sums`
        and returns the gradient norm."""
        self.optimizer.zero_grad(set_to_none=True)
        by_tokens = self.cfg.algorithm.aggregation == "token-mean"
        total = int(batch.loss_mask[part.start:part.stop].sum()) if by_tokens else len(part)
        if self.cfg.algorithm.loss_denominator == "batch":
            total *= (batch.fetched_samples + skipped) / batch.size  # the batch's samples, trained or not
        mine: Counter[str] = Counter()
        for sl, counts in self._micro(batch, part):
            logprobs, forward_tokens = self._logprobs(batch, sl)
            mask = batch.loss_mask[sl].to(self.device)
            with self._autocast():
                logp, entropy = self.policy(logprobs, temperature=self.temperature, with_entropy=True, positions=mask)
                ref = None
                if self.reference_policy is not None:
                    with torch.no_grad():
                        ref, _ = self.reference_policy(logprobs, temperature=self.temperature, positions=mask)
            logp_prox = logp.detach() if prox is None else prox[sl].to(self.device)
            loss, m = policy_loss(logp, logp_prox, batch.behaviour_logprobs[sl].to(self.device),
                                  batch.advantages[sl].to(self.device), mask, self.loss_cfg, ref)
            share = (mask.sum().item() if by_tokens else mask.shape[0]) / max(1, total) if counts else 0.0
            (loss * share).backward()
            n_tok = mask.sum().item() if counts else 0
            mine["entropy"] += float((entropy * mask).sum()) if counts else 0.0
            mine["loss"] += loss.item() * share
            mine["forward_tokens"] += forward_tokens if counts else 0
            for k, v in m.items():
                mine[k] += v * n_tok
        if self.world is not None:  # every rank has the same keys: a weight-0 pass adds them too
            keys = sorted(mine)
            mine = Counter(dict(zip(keys, distributed.all_sum([mine[k] for k in keys], self.world))))
        sums.update(mine)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # sharded: a DTensor
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        return float(grad_norm)

    def train_reply(self, reply: P.Message) -> tuple[Batch | None, dict[str, float]]:
        """Decode, check and train on one BATCH (a live step's or a replayed one): the batch and its metrics."""
        samples, rejected = decode_batch(reply, self.vocab, self.cfg.rollout.temperature or None)
        batch = build_batch(samples, rejected, self.cfg.algorithm.advantage, self.cfg.algorithm.drops_zero_spread(),
                            self.pad_id)
        metrics: dict[str, float] = {}
        if batch is not None and batch.size:
            metrics = self.train_on(batch, skipped=reply.header.get("skipped", 0))
        else:  # no update, but the step counts: the schedule runs in steps, to lr x min_lr_ratio at total_steps
            with warnings.catch_warnings():  # torch warns of a schedule step with no optimizer step before it
                warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)`", UserWarning)
                self.scheduler.step()
        return batch, metrics

    def save(self, step: int | None = None) -> None:
        """A checkpoint of the current state, after step `step` (the current one by default)."""
        step, keep = self.step if step is None else step, self.cfg.trainer.keep_checkpoints
        if self.world is None:
            checkpoint.save(self.ckpt_dir, step, self.version, self.model, self.optimizer, self.scheduler, keep)
        else:
            checkpoint.save_sharded(self.ckpt_dir, step, self.version, self.model, self.optimizer,
                                    self.scheduler, self.world, keep)

"""Two trainer settings, step for step on the same batches: which trains a step sooner, and do they agree?

    .venv/bin/python benchmarks/trainer_ab.py --b trainer.fused_optimizer=true [--a KEY=VALUE ...]
                                              [--steps N] [--config configs/arith.yaml] [--model PATH] [--smoke]

Two trainers (`rlbus.trainer.learner.Learner`) are built in this process from
the config, A with the `--a` overrides and B with the `--b` ones, from the
same seed. Each step both train on one batch shaped like the default
task's (4 prompts x 8 samples, a 30-token system prompt common to all, a
14-token question per group, 8-24 response tokens, rewards 0 or 1), in
turn, A first on even steps and B first on odd ones, so that a host that
speeds up or slows down weighs on both alike. The first step of each pays
one-time warm-up and is left out. Both are timed as the whole `train_on`
call (forward, backward, optimizer step).

Printed: each one's median seconds per step, the median of the paired
differences (A's step minus B's: positive when B is faster), and whether
the two left bitwise the same metrics (loss, gradient norm, KL, ...) and
weights. On a shared host the paired median is the figure to read: the
step times themselves drift with the host's load.

Last line: one JSON object with a_median_s, b_median_s, ratio (B's median
over A's), paired_median_diff_s, same_metrics, same_weights, steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as `rlbus trainer` sets it, before torch loads
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.harness import REPO, at_least  # noqa: E402
from benchmarks.trainer import GROUPS, QUESTION_TOKENS, SYSTEM_TOKENS  # noqa: E402
from rlbus.common.config import load_config  # noqa: E402
from rlbus.trainer.batch import Sample, build_batch  # noqa: E402
from rlbus.trainer.learner import Learner  # noqa: E402
from rlbus.weights.models import resolve_model  # noqa: E402

SYSTEM = np.random.default_rng(0).integers(100, 40000, SYSTEM_TOKENS)


def batch(step: int, vocab: int, groups: int = GROUPS, repeat: int = 8):
    """The batch of `step`: the same for both trainers, and in every run."""
    rng = np.random.default_rng(step)
    samples = []
    for g in range(groups):
        question = rng.integers(100, vocab, QUESTION_TOKENS)
        for i in range(repeat):
            n = int(rng.integers(8, 25))
            samples.append(Sample(f"{step}.{g}.{i}", g, float(rng.integers(0, 2)), 0, 0,
                                  np.concatenate([SYSTEM % vocab, question]).astype(np.int32),
                                  rng.integers(100, vocab, n).astype(np.int32), np.full(n, -1.0, np.float32),
                                  np.ones(n, np.uint8)))
    return build_batch(samples, {}, "grpo", True, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", action="append", default=[], metavar="KEY=VALUE", help="an override for trainer A")
    ap.add_argument("--b", action="append", default=[], metavar="KEY=VALUE", help="an override for trainer B")
    ap.add_argument("--steps", type=at_least(2), default=13, help="steps each, the first left out (default 13)")
    ap.add_argument("--config", default=str(REPO / "configs" / "arith.yaml"))
    ap.add_argument("--model", default="", help="model (default: the config's)")
    ap.add_argument("--smoke", action="store_true", help="two steps each: checks that the benchmark runs")
    args = ap.parse_args()
    if args.smoke:
        args.steps = 2
    with tempfile.TemporaryDirectory(prefix="rlbus-ab-") as tmp:
        learners = {}
        for name, sets in (("a", args.a), ("b", args.b)):
            model = [f"model.path={args.model}"] if args.model else []
            cfg = load_config(args.config, [f"run.dir={tmp}/{name}", *model, *sets])
            torch.manual_seed(0)
            learners[name] = Learner(cfg, resolve_model(cfg.model.path))
        vocab = min(learners["a"].vocab, 40000)
        times: dict[str, list[float]] = {"a": [], "b": []}
        metrics: dict[str, list[dict]] = {"a": [], "b": []}
        for step in range(args.steps):
            work = batch(step, vocab)
            for name in ("a", "b") if step % 2 == 0 else ("b", "a"):
                start = time.perf_counter()
                metrics[name].append(learners[name].train_on(work))
                times[name].append(time.perf_counter() - start)
            print(f"step {step}: A {times['a'][-1]:.3f} s, B {times['b'][-1]:.3f} s", flush=True)
        same_weights = all(torch.equal(p, q) for p, q in zip(learners["a"].model.parameters(),
                                                             learners["b"].model.parameters()))
    a, b = statistics.median(times["a"][1:]), statistics.median(times["b"][1:])
    paired = statistics.median(x - y for x, y in zip(times["a"][1:], times["b"][1:]))
    figures = {"a": args.a, "b": args.b, "a_median_s": round(a, 4), "b_median_s": round(b, 4),
               "ratio": round(b / a, 4), "paired_median_diff_s": round(paired, 4),
               "same_metrics": metrics["a"] == metrics["b"], "same_weights": same_weights, "steps": args.steps}
    print(f"A {args.a}: median {a:.3f} s a step; B {args.b}: median {b:.3f} s ({b / a:.3f} of A's); paired, A's "
          f"step minus B's: median {paired:+.3f} s; bitwise the same metrics: {figures['same_metrics']}, "
          f"weights: {same_weights}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

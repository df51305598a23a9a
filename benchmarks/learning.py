"""The default job, per seed: how soon held-out accuracy reaches 0.9, and whether it stays there.

    .venv/bin/python benchmarks/learning.py [--seeds N] [--first-seed K] [--config configs/arith.yaml]
                                            [--set KEY=VALUE ...]

Each seed is a real `rlbus up` of the config with `data.seed` and
`rollout.seed` set to the seed (0, 1, ...). From the run's logs:

- train_s_to_0_9: training time until the first held-out evaluation at or
  above 0.90, counted as TRL's GRPOTrainer time is counted on this task: the
  wall time from the start of the first rollout, minus the held-out
  evaluation passes in between (engine start-up comes before the first
  rollout; passes that ran beside training, with `explorer.eval_overlap`,
  are not taken out); wall_s_to_0_9 beside it, from the launcher's start;
- final_accuracy and last_three (the last three evaluations);
- steps_per_hour (over training time) and trained tokens/s (trainer compute);
- meets_targets: 0.9 within 330 s of training time, the last three
  evaluations at or above 0.90, the final one at or above 0.93.

TRL's GRPOTrainer on this machine and task (same 4 prompts x 8 samples per
step): 0.90 after 660 s of training, final 0.93 at 1810 s.

Last line: one JSON object with median_train_s_to_0_9, median_final_accuracy,
seeds_meeting_targets, seeds, and each seed's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import REPO, at_least  # noqa: E402
from rlbus.logview import events  # noqa: E402

TARGET_TRAIN_S, REACH, HOLD, FINAL = 330.0, 0.90, 0.90, 0.93


def analyse(run_dir: Path, started_ts: float) -> dict:
    """A finished run's figures from its logs."""
    logs = run_dir / "logs"
    evals = sorted(events(logs / "explorer-0.jsonl", "eval"), key=lambda e: e["ts"])
    batches = [e for name in sorted(p.stem for p in logs.glob("explorer-*.jsonl"))
               for e in events(logs / f"{name}.jsonl", "explorer_batch")]
    steps = events(logs / "trainer.jsonl", "train_step")
    if not evals or not batches or not steps:
        raise RuntimeError(f"{run_dir}: the run left no evaluations, rollouts or steps; see {logs}")
    origin = min(b["ts"] - b["rollout_s"] for b in batches)

    def train_time(ts: float) -> float:
        """Seconds from the first rollout to `ts`, held-out evaluation passes left out (those that ran beside
        training, `explorer.eval_overlap`, held nothing up and stay in)."""
        evaluating = sum(e["seconds"] for e in evals
                         if not e.get("overlapped") and e["ts"] - e["seconds"] >= origin and e["ts"] <= ts)
        return ts - origin - evaluating

    reached = next((e for e in evals if e["accuracy"] >= REACH), None)
    accuracies = [e["accuracy"] for e in evals]
    last_three = accuracies[-3:]
    train_s = train_time(steps[-1]["ts"])
    to_0_9 = round(train_time(reached["ts"]), 1) if reached else None
    compute = sum(s["compute_s"] for s in steps)
    figures = {
        "train_s_to_0_9": to_0_9,
        "wall_s_to_0_9": round(reached["ts"] - started_ts, 1) if reached else None,
        "version_at_0_9": reached["policy_version"] if reached else None,
        "final_accuracy": accuracies[-1],
        "last_three": last_three,
        "accuracy_by_train_s": [(round(max(0.0, train_time(e["ts"])), 1), e["policy_version"], e["accuracy"])
                                for e in evals],
        "train_s": round(train_s, 1),
        "wall_s": round(max(e["ts"] for e in evals + steps) - started_ts, 1),
        "steps": len(steps),
        "steps_per_hour": round(3600 * len(steps) / train_s, 1) if train_s > 0 else None,
        "trained_tokens_per_s": round(sum(s["tokens"] for s in steps) / compute, 1) if compute else None,
    }
    figures["meets_targets"] = bool(to_0_9 is not None and to_0_9 <= TARGET_TRAIN_S and len(last_three) == 3
                                    and min(last_three) >= HOLD and accuracies[-1] >= FINAL)
    return figures


def run_seed(config: str, seed: int, sets: list[str], root: Path) -> dict:
    run_dir = root / f"seed-{seed}"
    overrides = [f"run.dir={run_dir}", f"data.seed={seed}", f"rollout.seed={seed}", "broker.port=0",
                 "broker.pub_port=0", "logging.format=json", *sets]
    cmd = [sys.executable, "-m", "rlbus.cli", "up", config] + [x for s in overrides for x in ("--set", s)]
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(root / f"seed-{seed}.log", "w"),
                            start_new_session=True)
    try:
        code = proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)  # `rlbus up` stops its run and waits for it
        proc.wait()
        raise
    if code:
        raise RuntimeError(f"seed {seed}: rlbus up exited with {code}; see {root / f'seed-{seed}.log'}")
    return analyse(run_dir, started)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=at_least(1), default=3, help="how many seeds: first-seed .. first-seed + N - 1")
    ap.add_argument("--first-seed", type=at_least(0), default=0, help="the first seed (default 0)")
    ap.add_argument("--config", default=str(REPO / "configs" / "arith.yaml"))
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every seed (repeatable)")
    ap.add_argument("--out", default="", help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--model", default="", help="model for every seed (default: the config's)")
    ap.add_argument("--smoke", action="store_true", help="one seed, 2 steps, 4 held-out problems: checks that "
                                                          "the benchmark runs (its figures mean nothing)")
    args = ap.parse_args()
    sets = list(args.sets)
    if args.model:
        sets.append(f"model.path={args.model}")
    if args.smoke:
        args.seeds = 1
        sets += ["trainer.total_steps=2", "data.eval_size=4", "explorer.eval_every=1", "rollout.max_tokens=8",
                 "rollout.dtype=float32", "explorer.kv_cache_mb=256", "algorithm.skip_zero_spread=false",
                 "trainer.checkpoint_every=0"]
    with tempfile.TemporaryDirectory(prefix="rlbus-learning-") as tmp:
        root = Path(args.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        per_seed = {}
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            f = per_seed[seed] = run_seed(args.config, seed, sets, root)
            print(f"seed {seed}: 0.9 after {f['train_s_to_0_9']} s of training ({f['wall_s_to_0_9']} s wall, "
                  f"version {f['version_at_0_9']}); last three {f['last_three']}, final {f['final_accuracy']}; "
                  f"{f['steps']} steps in {f['train_s']} s of training ({f['wall_s']} s wall), "
                  f"{f['steps_per_hour']} steps/h, {f['trained_tokens_per_s']} trained tokens/s; "
                  f"targets {'met' if f['meets_targets'] else 'not met'}", flush=True)
    reached = [f["train_s_to_0_9"] for f in per_seed.values() if f["train_s_to_0_9"] is not None]
    summary = {
        # A seed that never reached 0.9 counts as slower than any that did.
        "median_train_s_to_0_9": round(statistics.median(reached + [float("inf")] * (len(per_seed) - len(reached))), 1)
        if per_seed else None,
        "median_final_accuracy": round(statistics.median(f["final_accuracy"] for f in per_seed.values()), 3),
        "seeds_meeting_targets": sum(f["meets_targets"] for f in per_seed.values()),
        "seeds": len(per_seed),
        "trl_train_s_to_0_9": 660.0,
        "per_seed": per_seed,
    }
    if summary["median_train_s_to_0_9"] == float("inf"):
        summary["median_train_s_to_0_9"] = None
    print(f"median: 0.9 after {summary['median_train_s_to_0_9']} s of training (TRL: 660 s); final accuracy "
          f"{summary['median_final_accuracy']}; {summary['seeds_meeting_targets']} of {summary['seeds']} seeds "
          "meet the targets")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

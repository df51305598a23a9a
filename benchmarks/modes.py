"""One workload in each mode, components pinned to their own cores: steps per hour, idle shares, staleness.

    .venv/bin/python benchmarks/modes.py [--quick] [--steps N] [--model smollm2-135m]

Each mode is a real `rlbus up` run of the default task (SmolLM2-135M,
"a + b", 4 prompts x 8 samples per step) from a preset in configs/modes/,
with the trainer on core 0 and the explorers on core 1. Every step trains
one batch's worth of groups, all-equal ones included (no `fill_batch`, no
zero-spread filter: otherwise the asynchronous modes, which pick the
informative groups out of more rollouts, would train more per step), so a
step is the same work in every mode. From the logs of each run:

- steps_per_hour over the steady part (the first `warmup` steps dropped);
- trainer_idle: share of step time the trainer waited for data;
- explorer_idle: share of the explorers' wall time their engine was not
  stepping (from their `explorer_activity` lines); explorer_idle_unheld:
  the same share of the time the broker was not holding them back (WAIT:
  too far ahead of the trainer); sequences_in_flight: the mean sequences
  each was generating;
- trajectories_per_hour: samples the explorers generated, per hour;
- staleness_mean: mean (step - policy version) of the trained samples;
- expired_share: share of all generated samples retired unused as too stale;
- R and T: median rollout seconds per explorer batch and median training
  seconds per step (compute + publish), both from the synchronous run.

For the asynchronous modes, speedup over synchronous sits beside the bound
(R + T) / max(R, T) of a two-stage pipeline. The last line is one JSON
object: `modes`, `async_speedup`, `bound`, `speedup_to_bound` (best
asynchronous mode), `R`, `T`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import REPO, at_least  # noqa: E402
from rlbus.logview import events as log_events  # noqa: E402

MODES = ["synchronous", "one_step_off_policy", "fully_async", "multi_explorer_async"]


def run_mode(mode: str, steps: int, model: str, root: Path, extra: tuple[str, ...] = (), tag: str = "") -> Path:
    run_dir = root / (tag or mode)
    # Ports 0: the broker binds free ones and `rlbus up` passes them on.
    sets = [f"run.dir={run_dir}", f"model.path={model}", "broker.port=0", "broker.pub_port=0",
            f"trainer.total_steps={steps}", "trainer.checkpoint_every=0",
            "explorer.eval_every=0", "algorithm.fill_batch=false", "data.batch_tasks=4", "rollout.repeat=8",
            "explorer.tasks_per_lease=4", "rollout.max_tokens=24", "trainer.lr=5e-6", "trainer.micro_batch=8",
            "explorer.kv_cache_mb=512",
            "algorithm.skip_zero_spread=false", "trainer.autocast=auto", "trainer.threads=1",
            "logging.format=json", "launch.status_interval_s=30", *extra]
    cmd = [sys.executable, "-m", "rlbus.cli", "up", str(REPO / "configs" / "modes" / f"{mode}.yaml")]
    cmd += [x for s in sets for x in ("--set", s)]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{mode}: rlbus up exited with {done.returncode}: {done.stderr[-2000:]}")
    print(f"{tag or mode}: ran {steps} steps in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return run_dir


def events(run_dir: Path, stem: str, event: str) -> list[dict]:
    return log_events(run_dir / "logs" / f"{stem}.jsonl", event)


def measure(run_dir: Path, warmup: int) -> dict:
    steps = sorted(events(run_dir, "trainer", "train_step"), key=lambda e: e["step"])
    steady = steps[warmup:]
    span = steady[-1]["ts"] - (steady[0]["ts"] - steady[0]["step_s"])
    staleness = [(int(k), n) for s in steady for k, n in s["staleness"].items()]
    samples = sum(n for _, n in staleness)
    out = {"steps": len(steady), "seconds": round(span, 1), "steps_per_hour": round(len(steady) / span * 3600, 1),
           "trainer_idle": round(sum(s["wait_s"] for s in steady) / sum(s["step_s"] for s in steady), 3),
           "staleness_mean": round(sum(k * n for k, n in staleness) / samples, 3) if samples else None,
           "T": round(statistics.median(s["compute_s"] + s["publish_s"] for s in steady), 3)}
    t0, t1 = steady[0]["ts"] - steady[0]["step_s"], steady[-1]["ts"]
    out.update(explorer_figures(run_dir, t0, t1))
    rollouts = [b["rollout_s"] for log in sorted((run_dir / "logs").glob("explorer-*.jsonl"))
                for b in events(run_dir, log.stem, "explorer_batch") if t0 <= b["ts"] - b["rollout_s"] < t1]
    out["R"] = round(statistics.median(rollouts), 3) if rollouts else None
    out["expired_share"] = expired_share(run_dir)
    return out


def explorer_figures(run_dir: Path, t0: float, t1: float) -> dict:
    """The explorers' figures over [t0, t1]: idle shares (mean over explorers), sequences in flight, and
    trajectories generated per hour."""
    idle, unheld, occupancy, made = [], [], [], 0
    for log in sorted((run_dir / "logs").glob("explorer-*.jsonl")):
        shares = idle_share(events(run_dir, log.stem, "explorer_activity"), t0, t1)
        if shares is not None:
            idle.append(shares[0])
            unheld.append(shares[1])
            occupancy.append(shares[2])
        made += sum(b["samples"] for b in events(run_dir, log.stem, "explorer_batch")
                    + events(run_dir, log.stem, "explorer_groups") if t0 <= b["ts"] < t1)
    mean = lambda xs, digits=3: round(statistics.mean(xs), digits) if xs else None  # noqa: E731
    return {"explorer_idle": mean(idle), "explorer_idle_unheld": mean(unheld),
            "sequences_in_flight": mean(occupancy, 2), "trajectories_per_hour": round(made / (t1 - t0) * 3600, 1)}


def idle_share(activity: list[dict], t0: float, t1: float) -> tuple[float, float, float] | None:
    """One explorer between its first and last `explorer_activity` lines inside [t0, t1]: the share of wall time
    its engine was not stepping; the same share of the time the broker did not hold it back (WAIT); and the
    mean sequences it was generating."""
    inside = [a for a in activity if t0 <= a["ts"] <= t1]
    if len(inside) < 2 or inside[-1]["wall_s"] <= inside[0]["wall_s"]:
        return None
    a, b = inside[0], inside[-1]
    wall, busy = b["wall_s"] - a["wall_s"], b["busy_s"] - a["busy_s"]
    free = wall - (b.get("held_s", 0.0) - a.get("held_s", 0.0))
    mean = (b["sequences_mean"] * b["wall_s"] - a["sequences_mean"] * a["wall_s"]) / wall
    return 1 - busy / wall, 1 - busy / free if free > 0 else 0.0, mean


def expired_share(run_dir: Path) -> float | None:
    """Share of all generated samples the broker retired as too stale (rollouts wasted), whole run."""
    made = sum(b["samples"] for log in (run_dir / "logs").glob("explorer-*.jsonl")
               for b in events(run_dir, log.stem, "explorer_batch") + events(run_dir, log.stem, "explorer_groups"))
    expired = sum(e["expired"] for e in events(run_dir, "broker", "groups_retired"))
    return round(expired / made, 4) if made else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="6 steps per mode (under 10 minutes here)")
    parser.add_argument("--steps", type=at_least(0), default=0, help="steps per mode (default 20; 6 with --quick)")
    parser.add_argument("--warmup", type=at_least(0), default=2, help="steps dropped from each run's figures")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    parser.add_argument("--smoke", action="store_true",
                        help="2 steps of one prompt in the synchronous mode: checks that it runs")
    args = parser.parse_args()
    smaller = ()
    if args.smoke:
        args.modes, args.steps, args.warmup = "synchronous", 2, 0
        smaller = ("data.batch_tasks=1", "explorer.tasks_per_lease=1")
    steps = args.steps or (6 if args.quick else 20)
    root = Path(tempfile.mkdtemp(prefix="rlbus-modes-"))
    results = {}
    for mode in args.modes.split(","):
        results[mode] = measure(run_mode(mode, steps, args.model, root, smaller), args.warmup)
        print(f"{mode}: {json.dumps(results[mode])}", flush=True)
    summary: dict = {"modes": results}
    sync = results.get("synchronous")
    if sync:
        r, t = sync["R"], sync["T"]
        bound = (r + t) / max(r, t)
        speedups = {m: round(v["steps_per_hour"] / sync["steps_per_hour"], 3) for m, v in results.items()
                    if m != "synchronous"}
        best = max(speedups, key=speedups.get) if speedups else None
        summary.update(R=r, T=t, bound=round(bound, 3), speedups=speedups, best_async_mode=best,
                       async_speedup=speedups.get(best), speedup_to_bound=round(speedups[best] / bound, 3)
                       if best else None)
    if args.keep:
        summary["run_dirs"] = str(root)
    else:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""Streaming explorers (in-flight weight updates) against batch-at-a-time multi-explorer async, same workload.

    .venv/bin/python benchmarks/streaming.py [--steps N] [--model smollm2-135m] [--workloads even,uneven]

Each pair of runs is benchmarks/modes.py's setting (SmolLM2-135M, 4 prompts
x 8 samples per step, trainer on core 0, two explorers on core 1, every
step the same work) from the presets `multi_explorer_async` and
`streaming`, which differ only in how the explorers work. Workloads:

- even: the default task ("a + b"), responses of at most 24 tokens;
- uneven: the countdown task with up to 160 tokens, where response lengths
  spread widely and a batch waits for its slowest sample.

From each run's logs (steady part): steps_per_hour, trajectories_per_hour
(generated), explorer_idle (share of the explorers' wall time their engine
was not stepping), staleness_mean, expired_share. The last line is one
JSON object with `streaming_idle_share` and `streaming_vs_async_steps_ratio`
(on the uneven workload) besides every figure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.modes import measure, run_mode  # noqa: E402

WORKLOADS = {
    "even": (),
    "uneven": ("data.taskset=countdown", "rollout.max_tokens=160"),
}
MODES = ["multi_explorer_async", "streaming"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16, help="steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps dropped from each run's figures")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--workloads", default="even,uneven")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    parser.add_argument("--smoke", action="store_true", help="2 steps of the even workload: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.workloads, args.steps, args.warmup = "even", 2, 0
    root = Path(tempfile.mkdtemp(prefix="rlbus-streaming-"))
    results: dict = {}
    for workload in args.workloads.split(","):
        for mode in MODES:
            tag = f"{workload}-{mode}"
            run_dir = run_mode(mode, args.steps, args.model, root, WORKLOADS[workload], tag)
            results.setdefault(workload, {})[mode] = measure(run_dir, args.warmup)
            print(f"{tag}: {json.dumps(results[workload][mode])}", flush=True)
    summary: dict = {"workloads": results}
    for workload, runs in results.items():
        batch, stream = runs["multi_explorer_async"], runs["streaming"]
        summary[f"{workload}_steps_ratio"] = round(stream["steps_per_hour"] / batch["steps_per_hour"], 3)
        summary[f"{workload}_trajectories_ratio"] = round(stream["trajectories_per_hour"]
                                                          / batch["trajectories_per_hour"], 3)
    key = "uneven" if "uneven" in results else next(iter(results))
    summary["streaming_idle_share"] = results[key]["streaming"]["explorer_idle"]
    summary["async_idle_share"] = results[key]["multi_explorer_async"]["explorer_idle"]
    summary["streaming_vs_async_steps_ratio"] = summary[f"{key}_steps_ratio"]
    if args.keep:
        summary["run_dirs"] = str(root)
    else:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""Trainer throughput on the bundled model, and the share of step time outside compute.

A real broker process holds a full buffer of trajectories shaped like the
default task's (4 prompts x 8 samples per step, 44 prompt and 24 response
tokens); an in-process trainer on SmolLM2-135M-Instruct (float32, CPU) runs
`--steps` steps, publishing weights every step (sync_interval 1, the most
publishing any mode does) and committing every step. Time outside compute =
waiting for the batch + publishing (the weight snapshot; writing happens on
the publishing thread) + commit.

    python benchmarks/trainer.py [--steps N]

Last line: one JSON object with tokens_per_s and non_compute_share.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import broker_process, free_port  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default="smollm2-135m", help="bundled model name or a model directory")
    ap.add_argument("--smoke", action="store_true", help="one timed step: checks that the benchmark runs")
    args = ap.parse_args()
    if args.smoke:
        args.steps = 1

    import numpy as np
    from structlog.testing import capture_logs

    from common.client import BrokerClient
    from common.config import load_config
    from common.trajectory import encode_payload
    from explorer.models import resolve_model
    from trainer.main import Trainer

    model = str(resolve_model(args.model))
    port, pub = free_port(), free_port()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-") as tmp:
        sets = [f"broker.port={port}", f"broker.pub_port={pub}", f"buffer.dir={tmp}/buffer", f"run.dir={tmp}",
                "sync.sync_style=async", "sync.max_staleness=1000", "data.repeat=8", "data.batch_tasks=4",
                "logging.level=warning"]
        with broker_process(sets, Path(tmp) / "buffer"):
            feeder = BrokerClient(f"tcp://127.0.0.1:{port}", "explorer", "feeder")
            feeder.start(30)
            for g in range(4 * (args.steps + 1)):
                items = []
                for i in range(8):
                    n = int(rng.integers(8, 25))
                    meta = {"id": f"g{g}.{i}", "group_id": f"g{g}", "task_id": f"g{g}", "group_size": 8,
                            "batch_index": g // 4, "policy_version": 0, "reward": float(i % 3 == 0), "n_tokens": n}
                    items.append((meta, encode_payload({
                        "prompt_ids": rng.integers(0, 49152, 44).astype(np.int32),
                        "response_ids": rng.integers(0, 49152, n).astype(np.int32),
                        "logprobs": np.full(n, -2.0, dtype=np.float32), "loss_mask": np.ones(n, dtype=np.uint8)})))
                feeder.put(items, timeout=30)
            feeder.close()
            cfg = load_config(None, sets + [f"broker.address=tcp://127.0.0.1:{port}", "trainer.checkpoint_every=0",
                                            f"trainer.total_steps={args.steps + 1}", "trainer.micro_batch=8",
                                            "sync.sync_interval=1"], environ={})
            trainer = Trainer(cfg, model)
            with capture_logs() as logs:
                trainer.run(max_steps=args.steps + 1)
    steps = [e for e in logs if e["event"] == "train_step"][1:]  # the first step pays one-time warm-up
    step_s = sum(e["step_s"] for e in steps)
    compute_s = sum(e["compute_s"] for e in steps)
    tokens = sum(e["tokens"] for e in steps)
    for e in steps:
        print(f"step {e['step']}: {e['tokens']} tokens, compute {e['compute_s']:.2f} s, wait {e['wait_s']:.3f} s, "
              f"publish {e['publish_s']:.3f} s, step {e['step_s']:.2f} s")
    share = (step_s - compute_s) / step_s
    print(f"{tokens / compute_s:.1f} trained tokens/s; {share:.3%} of step time outside compute")
    print(json.dumps({"tokens_per_s": round(tokens / compute_s, 1), "non_compute_share": round(share, 4),
                      "steps": len(steps), "mean_step_s": round(step_s / len(steps), 2),
                      "mean_wait_s": round(sum(e["wait_s"] for e in steps) / len(steps), 3),
                      "mean_publish_s": round(sum(e["publish_s"] for e in steps) / len(steps), 3)}))


if __name__ == "__main__":
    main()

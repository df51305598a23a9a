"""Where an explorer's time goes, on the bundled model (SmolLM2-135M-Instruct).

A real broker process and an in-process explorer with a real vLLM engine
(CPU here) run `--batches` explorer batches of the default job. Every
`--reload-every` batches a checkpoint is published, so the explorer also
loads weights the way it does in a run. The wall time of the explorer loop
is split into time inside vLLM's engine steps (the engine's own count:
rollouts and held-out evaluations) and everything else (broker I/O,
rewards, payload encoding, weight loads). The same run times the checkpoint
reload beside a plain read of the same files, and a decode step with 1, 2,
4, ... 32 sequences in it: what the tail of a batch, when few samples are
left, costs per token.

    python benchmarks/explorer.py [--batches N] [--reload-every K]

Last line: one JSON object with generate_share, reload_s, file_read_s,
digest_s and decode_step_ms (milliseconds by sequences in the step).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.harness import at_least, broker_process  # noqa: E402


def read_files(directory: Path) -> float:
    started = time.perf_counter()
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass
    return time.perf_counter() - started


def decode_step_ms(engine, sequences: tuple[int, ...], max_tokens: int) -> dict[str, float]:
    """Median milliseconds of a decode step with each number of sequences in it (one request of that many samples
    of one prompt; its prefill and first step left out): what a batch's tail costs per token."""
    import statistics

    prompt = engine.chat_prompt([{"role": "user", "content": "Write a long story about a cat."}])
    out = {}
    for n in sequences:
        engine.submit(f"steps-{n}", prompt, n=n, max_tokens=max_tokens)
        times = []
        while engine.in_flight:
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
        out[str(n)] = round(statistics.median(times[2:]) * 1e3, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=at_least(1), default=12)
    ap.add_argument("--reload-every", type=at_least(0), default=4, help="a checkpoint every K batches (0: never)")
    ap.add_argument("--model", default="smollm2-135m", help="bundled model name or a model directory")
    ap.add_argument("--smoke", action="store_true", help="2 batches, a load after each: checks that it runs")
    args = ap.parse_args()
    if args.smoke:
        args.batches, args.reload_every = 2, 1

    from rlbus.common import protocol as P
    from rlbus.common.client import BrokerClient
    from rlbus.common.config import load_config
    from rlbus.common.logging import setup_logging
    from rlbus.weights.digest import weights_digest
    from rlbus.explorer.engine import Engine
    from rlbus.explorer.main import Explorer
    from rlbus.weights.models import resolve_model, with_rollout_dtype
    from rlbus.weights.sync import load_checkpoint

    setup_logging("bench", "warning", "json")
    model = Path(resolve_model(args.model))
    job = REPO / "configs" / "arith.yaml"  # broker and explorer agree on the default job's rollout settings
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-") as tmp, \
            broker_process([f"buffer.dir={tmp}", f"run.dir={tmp}", "sync.sync_style=async",
                            "sync.max_staleness=1000", "logging.level=warning"], Path(tmp), config=job) as broker:
        cfg = with_rollout_dtype(load_config(job,
                                             [f"broker.address={broker.address}", f"broker.pub_port={broker.pub_port}",
                                              "sync.sync_style=async", "sync.max_staleness=1000"], environ={}))
        # The default job's engine; its core stops on the way out.
        with Engine(str(model), dtype=cfg.rollout.dtype, seed=0, kv_cache_mb=cfg.explorer.kv_cache_mb) as engine:
            engine.warm_up()
            trainer = BrokerClient(broker.address, "trainer", "bench-trainer")
            trainer.start(30)
            digest = weights_digest(model)
            explorer = Explorer(cfg, engine, name="bench-explorer")
            explorer.connect()
            published = [0]

            def publisher() -> None:
                # A new version after every K batches, as a trainer publishing checkpoints would.
                while explorer.batches < args.batches and args.reload_every:
                    due = explorer.batches // args.reload_every
                    if due > published[0]:
                        published[0] = due
                        trainer.request(P.PUBLISH, {"version": due, "method": "checkpoint",
                                                    "location": str(model), "digest": digest, "step": due})
                    time.sleep(0.01)

            thread = threading.Thread(target=publisher, daemon=True)
            thread.start()
            started, busy = time.perf_counter(), engine.busy_s
            explorer.run(max_batches=args.batches)
            wall = time.perf_counter() - started
            gen_time = engine.busy_s - busy  # in engine steps: generation, rollouts and evaluations alike
            trainer.close()
            def reload(version: int) -> float:
                started = time.perf_counter()
                load_checkpoint(engine, str(model), digest, version)
                return time.perf_counter() - started

            reload_s = min(reload(published[0] + 1 + i) for i in range(3))
            file_read_s = min(read_files(model) for _ in range(3))
            digest_s = min((lambda t: (weights_digest(model), time.perf_counter() - t)[1])(time.perf_counter())
                           for _ in range(2))
            steps = decode_step_ms(engine, (1, 4) if args.smoke else (1, 2, 4, 8, 16, 32), 8 if args.smoke else 48)
    share = gen_time / wall
    print(f"explorer wall {wall:.2f} s over {args.batches} batches ({published[0]} weight loads), "
          f"{gen_time:.2f} s generating: share {share:.3f}")
    print(f"checkpoint reload {reload_s:.3f} s (digest {digest_s:.3f} s of it), "
          f"plain read of the files {file_read_s:.3f} s")
    print("decode step by sequences in it: " + ", ".join(f"{n}: {ms} ms" for n, ms in steps.items()))
    print(json.dumps({"generate_share": round(share, 4), "reload_s": round(reload_s, 3),
                      "file_read_s": round(file_read_s, 3), "digest_s": round(digest_s, 3), "decode_step_ms": steps,
                      "batches": args.batches, "reload_every": args.reload_every, "weight_loads": published[0],
                      "wall_s": round(wall, 2)}))


if __name__ == "__main__":
    main()

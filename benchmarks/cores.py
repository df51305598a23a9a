"""What a busy process on one of an explorer's cores costs it, and what fewer engine threads win back.

An explorer's engine (vLLM, its core inline) computes on one OpenMP thread per
core it may use, and those threads wait for each other at every operation.
For each thread count (the engine's default, and `--threads`: explorer.threads)
a child process starts the default job's engine and, quiet and then beside a
rival (a process spinning on whichever core Linux gives it, from the first
timed step to the last), times `--steps` decode steps of one request of
`--sequences` samples (prefill left out) and reads how long the process's
threads waited for a core meanwhile (`core_wait`, rlbus.common.cores, as
explorers log it).

    python benchmarks/cores.py [--steps N] [--sequences S] [--threads T]

Last line: one JSON object: decode_step_ms and core_wait by case;
rival_ratio (beside a rival / quiet, default threads), rival_ratio_fewer (the
same with --threads) and fewer_ratio (--threads / default threads, quiet).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.harness import at_least  # noqa: E402
from rlbus.common.processes import terminate_with  # noqa: E402

PLACES = ("quiet", "rival")


def measure(model: str, threads: int, steps: int, sequences: int) -> dict:
    """In this process, on one engine, quiet and beside a rival: the median decode step (ms) and the threads'
    core_wait over the timed steps."""
    from rlbus.common.config import load_config
    from rlbus.common.logging import setup_logging
    from rlbus.explorer.engine import Engine
    from rlbus.weights.models import resolve_model, with_rollout_dtype

    setup_logging("bench", "warning", "json")
    cfg = with_rollout_dtype(load_config(REPO / "configs" / "arith.yaml", [], environ={}))
    with Engine(resolve_model(model), dtype=cfg.rollout.dtype, seed=0, kv_cache_mb=cfg.explorer.kv_cache_mb,
                core="inline", threads=threads) as engine:
        engine.warm_up()
        prompt = engine.chat_prompt([{"role": "user", "content": "Write a long story about a cat."}])
        return {place: {**timed(engine, prompt, place == "rival", steps, sequences), "threads": engine.threads}
                for place in PLACES}


def timed(engine, prompt: list[int], rival: bool, steps: int, sequences: int) -> dict:
    from rlbus.common.cores import CoreWait

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                               preexec_fn=partial(terminate_with, os.getpid())) if rival else None
    try:
        time.sleep(0.2 if rival else 0)  # the rival spinning
        waits = CoreWait("explorer.threads", engine.threads)
        times: list[float] = []
        while len(times) < steps:
            engine.submit(f"timed-{rival}-{len(times)}", prompt, n=sequences,
                          max_tokens=min(steps - len(times), 64) + 1)
            first = True
            while engine.in_flight:
                started = time.perf_counter()
                engine.step()
                if not first:  # the request's prefill left out
                    times.append(time.perf_counter() - started)
                first = False
        share = waits.share()
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return {"decode_step_ms": round(statistics.median(times) * 1e3, 2), "core_wait": round(share or 0.0, 3),
            "steps": len(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=at_least(2), default=60, help="decode steps timed in each case")
    ap.add_argument("--sequences", type=at_least(1), default=1, help="samples of the one request being decoded")
    ap.add_argument("--threads", type=at_least(1), default=1, help="the fewer threads tried (explorer.threads)")
    ap.add_argument("--model", default="smollm2-135m", help="bundled model name or a model directory")
    ap.add_argument("--smoke", action="store_true",
                    help="4 steps a case, one engine whose figures stand for both thread counts: checks that it runs")
    ap.add_argument("--child", metavar="THREADS", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.steps = 4
    if args.child:
        print(json.dumps(measure(args.model, int(args.child), args.steps, args.sequences)))
        return

    results = {}
    for threads in (0,) if args.smoke else (0, args.threads):
        done = subprocess.run([sys.executable, __file__, "--child", str(threads), "--model", args.model,
                               "--steps", str(args.steps), "--sequences", str(args.sequences)],
                              capture_output=True, text=True, timeout=900)
        if done.returncode:
            sys.exit(f"the cases with threads {threads or 'default'} failed: {done.stderr[-3000:]}")
        for place, r in json.loads(done.stdout.splitlines()[-1]).items():
            results[f"{place}_{threads or 'default'}"] = r
            print(f"{place:5} threads {r['threads']}: decode step {r['decode_step_ms']} ms, "
                  f"core_wait {r['core_wait']}", flush=True)
    fewer = args.threads
    if args.smoke:  # one engine start fewer; the smoke's figures mean nothing
        results.update({f"{place}_{fewer}": results[f"{place}_default"] for place in PLACES})
    ms = {name: r["decode_step_ms"] for name, r in results.items()}
    figures = {"rival_ratio": round(ms["rival_default"] / ms["quiet_default"], 2),
               "rival_ratio_fewer": round(ms[f"rival_{fewer}"] / ms[f"quiet_{fewer}"], 2),
               "fewer_ratio": round(ms[f"quiet_{fewer}"] / ms["quiet_default"], 2)}
    print(f"beside a rival: {figures['rival_ratio']}x the quiet step with the default threads, "
          f"{figures['rival_ratio_fewer']}x with {fewer}; {fewer} thread(s) quiet: {figures['fewer_ratio']}x")
    print(json.dumps({**figures, "decode_step_ms": ms, "core_wait": {n: r["core_wait"] for n, r in results.items()},
                      "threads": {n: r["threads"] for n, r in results.items()}, "steps": args.steps,
                      "sequences": args.sequences}))


if __name__ == "__main__":
    main()

"""Streaming explorers (in-flight weight updates) against batch-at-a-time multi-explorer async, same workload.

    .venv/bin/python benchmarks/streaming.py [--trainer paced|real] [--steps N] [--model smollm2-135m]
                                             [--workloads even,uneven,long]

Each workload runs the presets `multi_explorer_async` and `streaming` (as
shipped: `explorer.swap_kv: keep`, `explorer.swap_lag: 2`, a swap every
second version; with a swap per version as `streaming_keep`, and with the
KV recomputed at each as `streaming_recompute`), which differ only in how
the explorers work, with benchmarks/modes.py's
settings (SmolLM2-135M, 4 prompts x 8 samples per step, every step the same
work). Workloads:

- even: the default task ("a + b"), responses of at most 24 tokens;
- uneven: the countdown task with up to 160 tokens, where response lengths
  spread widely and a batch waits for its slowest sample;
- long: the same with up to 512 tokens (SmolLM2-135M at temperature 1.1:
  half its answers under 50 tokens, three in ten run to the limit), where
  that wait is longest.

Trainers:

- paced (default): the explorers are the bottleneck. A stand-in trainer in
  this process FETCHes each step's groups as soon as they are ready,
  COMMITs, and publishes the next version at once (the same weights under a
  new version number, so every explorer really loads every version); the
  two explorers get a core each. steps_per_hour is then what the explorers
  can feed.
- real: `rlbus up` with the real trainer on core 0 and both explorers on
  core 1, as benchmarks/modes.py. On two cores the trainer is the
  bottleneck (a step takes longer to train than to generate), so both modes
  give the trainer's pace and the explorers are held back.

From each run's logs (steady part): steps_per_hour, trajectories_per_hour
(generated), explorer_idle (share of the explorers' wall time their engine
was not stepping), explorer_idle_unheld (the same, of the time the broker
was not holding them back), sequences_in_flight, staleness_mean,
expired_share. The last line is one JSON object with `streaming_idle_share`
and `streaming_vs_async_steps_ratio` (on the uneven workload) besides every
figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import REPO, at_least, bound_ports  # noqa: E402
from benchmarks.modes import explorer_figures, measure, run_mode  # noqa: E402

WORKLOADS = {
    "even": (),
    "uneven": ("data.taskset=countdown", "rollout.max_tokens=160"),
    "long": ("data.taskset=countdown", "rollout.max_tokens=512"),  # explorer.kv_cache_mb: 32 such sequences fit
}
# name: (preset, settings beside it)
MODES = {"multi_explorer_async": ("multi_explorer_async", ()), "streaming": ("streaming", ()),
         "streaming_keep": ("streaming", ("explorer.swap_lag=1",)),
         "streaming_recompute": ("streaming", ("explorer.swap_kv=recompute", "explorer.swap_lag=1"))}
SETTINGS = ["trainer.checkpoint_every=0", "explorer.eval_every=0", "algorithm.fill_batch=false", "data.batch_tasks=4",
            "rollout.repeat=8", "explorer.tasks_per_lease=4", "rollout.max_tokens=24", "explorer.kv_cache_mb=512",
            "algorithm.skip_zero_spread=false", "logging.format=json"]


def run_paced(mode: str, steps: int, model: str, root: Path, extra: tuple[str, ...], tag: str, warmup: int,
              explorers: int = 2) -> dict:
    """Broker and explorers as processes, a stand-in trainer here (see the module docstring); the figures."""
    from rlbus.common import protocol as P
    from rlbus.common.client import BrokerClient
    from rlbus.common.config import load_config
    from rlbus.weights.digest import weights_digest
    from rlbus.weights.models import resolve_model

    run_dir = root / tag
    logs, weights = run_dir / "logs", run_dir / "weights"
    logs.mkdir(parents=True)
    model_dir = Path(resolve_model(model))
    preset = REPO / "configs" / "modes" / f"{mode}.yaml"
    sets = [f"run.dir={run_dir}", f"model.path={model_dir}", "sync.serve=false", *SETTINGS, *extra]
    cfg = load_config(preset, sets, environ={})
    base = weights / "base"  # one copy on this file system, hard-linked as every version
    shutil.copytree(model_dir, base)
    digest = weights_digest(base)
    procs: list[subprocess.Popen] = []

    def start(command: str, name: str, cpu: int | None, *more: str) -> None:
        args = [sys.executable, "-m", "rlbus.cli", command, str(preset), *more,
                *[x for s in sets + [f"logging.file={logs / (name + '.jsonl')}"] for x in ("--set", s)]]
        with open(logs / f"{name}.out", "wb") as out:
            # In this process's group: whoever stops the benchmark by its group stops them too.
            procs.append(subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                          preexec_fn=(lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None
                                          else None))

    steps_at, staleness = [], []
    client = None
    try:
        start("broker", "broker", None, "--set", "broker.port=0", "--set", "broker.pub_port=0")
        port, pub_port = bound_ports(cfg.buffer_dir(), procs[0])
        sets += [f"broker.address=tcp://127.0.0.1:{port}", f"broker.pub_address=tcp://127.0.0.1:{pub_port}"]
        for i in range(explorers):
            start("explorer", f"explorer-{i}", i % os.cpu_count(), "--name", f"explorer-{i}")
        client = BrokerClient(f"tcp://127.0.0.1:{port}", "trainer", "trainer", bus_address=None)
        client.start(timeout=60)
        while sum(p["role"] == "explorer" for p in client.request(P.STATUS).header["peers"]) < explorers:
            exited(procs, logs)
            time.sleep(0.5)
        step = 0
        while step < steps:
            reply = client.request(P.FETCH, {"step": step, "max_groups": cfg.data.batch_tasks,
                                             "min_groups": cfg.data.batch_tasks, "wait_ms": 10_000}, timeout=60)
            if reply.command != P.BATCH or len(reply.header["groups"]) < cfg.data.batch_tasks:
                exited(procs, logs)
                continue
            staleness += [step - t["policy_version"] for g in reply.header["groups"] for t in g["trajectories"]]
            client.request(P.COMMIT, {"step": step})
            step += 1
            version_dir = weights / f"v{step}"
            shutil.copytree(base, version_dir, copy_function=os.link)  # the same bytes, a new version
            client.request(P.PUBLISH, {"version": step, "method": "checkpoint", "location": str(version_dir),
                                       "digest": digest, "step": step})
            steps_at.append(time.time())
    finally:
        if client is not None:
            client.close(bye=True)
        for group in (procs[1:], procs[:1]):  # the explorers first, so that the broker is there for their BYE
            for proc in group:
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGTERM)
            for proc in group:
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    print(f"{tag}: ran {steps} steps", file=sys.stderr, flush=True)
    return measure_paced(run_dir, steps_at, staleness, cfg.data.batch_tasks * cfg.rollout.repeat, warmup)


def exited(procs: list[subprocess.Popen], logs: Path) -> None:
    """Raise if a component has exited (the run cannot go on)."""
    for proc in procs:
        if proc.poll() is not None:
            raise RuntimeError(f"a component exited with {proc.returncode}: {' '.join(proc.args[3:5])}; see {logs}")


def measure_paced(run_dir: Path, steps_at: list[float], staleness: list[int], per_step: int, warmup: int) -> dict:
    """Figures over the steps after the first `warmup` (at least one: the window opens when it ends)."""
    warmup = max(1, warmup)
    t0, t1 = steps_at[warmup - 1], steps_at[-1]
    n = len(steps_at) - warmup
    steady = staleness[warmup * per_step:]
    return {"steps": n, "seconds": round(t1 - t0, 1), "steps_per_hour": round(n / (t1 - t0) * 3600, 1),
            **explorer_figures(run_dir, t0, t1),
            "staleness_mean": round(sum(steady) / len(steady), 3) if steady else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trainer", choices=["paced", "real"], default="paced")
    parser.add_argument("--steps", type=at_least(1), default=16, help="steps per run")
    parser.add_argument("--warmup", type=at_least(0), default=3, help="steps dropped from each run's figures")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--workloads", default="even,uneven,long", help=f"of {', '.join(WORKLOADS)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    parser.add_argument("--explorers", type=at_least(1), default=2, help="explorers per run (paced trainer)")
    parser.add_argument("--smoke", action="store_true",
                        help="3 steps of the even workload, streaming, one explorer: checks that it runs (the "
                             "batch baseline is the same run with another preset)")
    args = parser.parse_args()
    if args.smoke:
        args.workloads, args.modes, args.steps, args.warmup, args.explorers = "even", "streaming", 3, 1, 1
    root = Path(tempfile.mkdtemp(prefix="rlbus-streaming-"))
    results: dict = {}
    for workload in args.workloads.split(","):
        for mode in args.modes.split(","):
            tag = f"{workload}-{mode}"
            preset, settings = MODES[mode]
            extra = (*WORKLOADS[workload], *settings)
            if args.trainer == "paced":
                figures = run_paced(preset, args.steps, args.model, root, extra, tag, args.warmup, args.explorers)
            else:
                figures = measure(run_mode(preset, args.steps, args.model, root, extra, tag), args.warmup)
            results.setdefault(workload, {})[mode] = figures
            print(f"{tag}: {json.dumps(results[workload][mode])}", flush=True)
    summary: dict = {"trainer": args.trainer, "workloads": results}
    for workload, runs in results.items():
        batch = runs.get("multi_explorer_async")
        for mode, figures in runs.items():
            if batch and mode != "multi_explorer_async":
                summary[f"{workload}_{mode}_steps_ratio"] = round(figures["steps_per_hour"]
                                                                  / batch["steps_per_hour"], 3)
    key = "uneven" if "uneven" in results else next(iter(results))
    runs = results[key]
    for mode in (m for m in runs if m.startswith("streaming")):
        summary[f"{mode}_idle_share"] = runs[mode]["explorer_idle"]
        summary[f"{mode}_vs_async_steps_ratio"] = summary.get(f"{key}_{mode}_steps_ratio")
    if args.keep:
        summary["run_dirs"] = str(root)
    else:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

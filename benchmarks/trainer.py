"""Trainer throughput on the bundled model: shared-prompt training against one row per sample.

A real broker process holds a full buffer of trajectories shaped like the
default task's (4 prompts x 8 samples per step; each prompt a 30-token system
prompt common to all and a 14-token question shared by its group; 8-24
response tokens); an in-process trainer on SmolLM2-135M-Instruct
(`trainer.autocast=auto`: bfloat16 where the CPU computes faster in it) runs
`--steps` steps, publishing weights every step (sync_interval 1, the most
publishing any mode does) and committing every step. It runs twice, on a fresh
broker each time: one row per sample (micro-batches of 8, the baseline) and
shared-prompt packing (the whole batch as one packed sequence). Time outside
compute = waiting for the batch + publishing (the weight snapshot; writing
happens on the publishing thread) + commit.

With `--world-size N` it then runs the shared-prompt variant as `rlbus
trainer` processes, at world size 1 and at N (FSDP2 ranks on this host's
cores), and reports each one's trained tokens/s, time outside compute, and
publishing: the snapshot on the training thread (at N, gathered from the
shards) and the whole publish (written and announced). On a 2-core machine
no speedup is expected at N = 2; the figure is there to catch overhead.

With `--serve N` it then measures what serving weights costs the trainer:
the shared-prompt variant as an `rlbus trainer` process pinned to half of
this host's cores (the other half stands for the explorers' hosts: the
broker and N fetch clients run there), with nobody fetching, with N clients
that fetch every version it publishes from its weight server (`sync.serve`,
deltas on, as explorers on other hosts do), with the server building deltas
at normal priority instead of idle (`sync.serve_delta_priority`), and with
the same clients taking whole versions only, and with the clients fetching
from an `rlbus mirror` on their side, which alone fetches from the trainer
(whole versions, and with --deltas its deltas); `--serve-rounds`
alternations of the six. The server's reads and sends run in the trainer's process and
its delta builds in children of it, all on its cores, so the step time with
clients against without is the slowdown that serving causes. Step i trains the same batch in every run, so steps are
also compared in pairs.

    python benchmarks/trainer.py [--steps N] [--world-size N] [--serve N [--serve-rounds R]] [--set KEY=VALUE ...]

`--set` passes a config override to every trainer it runs: `--set trainer.device=cuda` measures a GPU, and
with `--set trainer.deterministic=false` SDPA's fused kernels instead of the plain attention that
deterministic training takes there.

Last line: one JSON object with tokens_per_s and non_compute_share (shared
prompts), ratio_to_rows, each variant's figures, with --world-size a "ranks"
object (per world size, and the ratio of N's tokens/s to 1's), and with
--serve a "serving" object: per variant (deltas, deltas_normal, whole, mirror, mirror_deltas) its
step_slowdown (total step time over the baseline's, minus 1), the median of
the paired steps', the versions its clients fetched, and the CPU that
serving took on the trainer's core: serving_cpu_s_per_step (the trainer
process's CPU outside its training thread, children included, over the
baseline's, per step), serving_cpu_share (that over the baseline's step
time) and training_thread_cpu_change (the training thread's CPU over the
baseline's, minus 1: contention for caches and memory); step_slowdown at
the top is the deltas'.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import at_least, broker_process, thread_cpu  # noqa: E402


SYSTEM_TOKENS, QUESTION_TOKENS = 30, 14  # the default task's prompt: chat template's system prompt + question
GROUPS = 4  # prompts (of 8 samples) per step, as in the default task (the smoke trains 1: `groups`)


def fill(address: str, steps: int, groups: int) -> None:
    """The broker's buffer: `steps` batches of default-task-shaped groups (the same ones on every call)."""
    import numpy as np

    from rlbus.common.client import BrokerClient
    from rlbus.common.trajectory import encode_payload

    rng = np.random.default_rng(0)
    system = rng.integers(0, 49152, SYSTEM_TOKENS).astype(np.int32)
    feeder = BrokerClient(address, "explorer", "feeder")
    feeder.start(30)
    for g in range(groups * steps):
        prompt = np.concatenate([system, rng.integers(0, 49152, QUESTION_TOKENS).astype(np.int32)])
        items = []
        for i in range(8):
            n = int(rng.integers(8, 25))
            meta = {"id": f"g{g}.{i}", "group_id": f"g{g}", "task_id": f"g{g}", "group_size": 8,
                    "batch_index": g // groups, "policy_version": 0, "reward": float(i % 3 == 0), "n_tokens": n}
            items.append((meta, encode_payload({
                "prompt_ids": prompt, "response_ids": rng.integers(0, 49152, n).astype(np.int32),
                "logprobs": np.full(n, -2.0, dtype=np.float32), "loss_mask": np.ones(n, dtype=np.uint8)})))
        feeder.put(items, timeout=30)
    feeder.close()


class Holder:
    """What a fetch client needs of an engine: the version it holds (nothing is reloaded)."""

    version = 0

    def reload(self, source: dict, version: int) -> dict:
        self.version = version
        return {}


def fetcher(broker: str, bus: str, fetch_dir: str, stop, results, fetch_from: str = "") -> None:
    """A fetch client on another host: every version the bus announces, fetched from the trainer's weight
    server (or from `fetch_from`, a mirror) by the explorer's own receiver (a delta against the version held,
    when the server has one)."""
    from structlog.testing import capture_logs

    from rlbus.common.client import BrokerClient
    from rlbus.weights.sync import Receiver

    announced: queue.Queue = queue.Queue()
    client = BrokerClient(broker, "tool", bus_address=bus, on_weights=announced.put)
    client.start(60)
    # A fetch that has begun when the trainer exits waits for its server this long (silent) before the client
    # stops: each run's last version costs that wait (10 s made the smoke's two serving runs 18 s longer).
    receiver, engine = Receiver("fetcher", fetch_dir, mode="fetch", fetch_timeout_s=3, fetch_from=fetch_from), Holder()
    with capture_logs() as logs:
        while not stop.is_set():
            try:
                state = announced.get(timeout=0.2)
            except queue.Empty:
                continue
            while not announced.empty():  # only the newest matters
                state = announced.get_nowait()
            if state.get("fetch_from") and state["version"] > engine.version:
                receiver.load(engine, state)
    receiver.close()
    client.close(bye=True)
    results.put([{k: e[k] for k in ("policy_version", "base", "bytes", "seconds")}
                 for e in logs if e["event"] == "weights_fetched"])


def run_variant(model: str, steps: int, shared_prompt: bool, micro_batch: int, world: int = 0,
                extra: list[str] = (), fetched: list[dict] | None = None, fetchers: int = 0, groups: int = GROUPS,
                mirror: str = "", cpu: list[dict] | None = None) -> tuple[list[dict], list[dict]]:
    """`steps` + 1 trainer steps against a broker filled with default-task-shaped groups: their train_step
    events (the first, which pays one-time warm-up, left out) and weights_published events. In this process,
    or with `world` > 0 as `rlbus trainer` with that many ranks. Given a `fetched` list (and `world` 1), the
    trainer runs on half of this host's cores, and the broker and `fetchers` fetch clients on the other half;
    each weights_fetched event of theirs is added to the list. With `mirror` ("whole" or "deltas"), they fetch
    from an `rlbus mirror` there, which alone fetches from the trainer, whole versions or deltas. Given a `cpu`
    list, the trainer process's CPU is added to it."""
    cores = sorted(os.sched_getaffinity(0))
    trainer_cores, other_cores = set(cores[:len(cores) // 2]), set(cores[len(cores) // 2:])
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-") as tmp:
        sets = [f"buffer.dir={tmp}/buffer", f"run.dir={tmp}",
                "sync.sync_style=async", "sync.max_staleness=1000", "rollout.repeat=8", f"data.batch_tasks={groups}",
                "logging.level=warning"]
        pinned = fetched is not None
        if pinned:
            os.sched_setaffinity(0, other_cores)  # the broker and the fetch clients inherit the other half
        ctx = mp.get_context("spawn")
        stop, results = ctx.Event(), ctx.Queue()
        clients: list = []
        mirrored = None
        try:
            with broker_process(sets, Path(tmp) / "buffer") as broker:
                fill(broker.address, steps + 1, groups)
                if mirror and pinned:
                    mirrored = subprocess.Popen(
                        [sys.executable, "-m", "rlbus.cli", "mirror", "--broker", broker.address, "--dir",
                         f"{tmp}/mirror", "--set", f"broker.pub_port={broker.pub_port}",
                         "--set", "logging.level=warning", *(["--deltas"] if mirror == "deltas" else [])],
                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                fetch_from = mirrored.stdout.readline().strip() if mirrored else ""
                clients = [ctx.Process(target=fetcher, args=(broker.address, f"tcp://127.0.0.1:{broker.pub_port}",
                                                             f"{tmp}/fetched-{i}", stop, results, fetch_from))
                           for i in range(fetchers if pinned else 0)]
                for c in clients:
                    c.start()
                sets += [f"broker.address={broker.address}", f"broker.pub_port={broker.pub_port}"]
                logs = train(model, steps, shared_prompt, micro_batch, world, sets, extra,
                             trainer_cores if pinned else None, Path(tmp))
                if cpu is not None:
                    cpu.extend(e for e in logs if e["event"] == "process_cpu")
                stop.set()
                for _ in clients:
                    try:
                        fetched.extend(results.get(timeout=120))
                    except queue.Empty:
                        raise RuntimeError(f"a fetch client gave no figures (exit codes: "
                                           f"{[c.exitcode for c in clients]})") from None
        finally:  # a trainer that failed leaves no client behind (they would keep this process from exiting)
            stop.set()
            for c in clients:
                if c.pid is not None:
                    c.join(30)
                    if c.exitcode is None:
                        c.kill()
                        c.join()
            if mirrored is not None:
                mirrored.terminate()
                try:
                    mirrored.wait(30)
                except subprocess.TimeoutExpired:
                    mirrored.kill()
                    mirrored.wait()
            os.sched_setaffinity(0, set(cores))
    return ([e for e in logs if e["event"] == "train_step"][1:],
            [e for e in logs if e["event"] == "weights_published" and "seconds" in e][1:])


def train(model: str, steps: int, shared_prompt: bool, micro_batch: int, world: int, sets: list[str],
          extra: list[str], cores: set[int] | None, tmp: Path) -> list[dict]:
    """The trainer's log: in this process, or with `world` > 0 as `rlbus trainer` (pinned to `cores`, with as
    many threads, when given)."""
    from structlog.testing import capture_logs

    from rlbus.common.config import load_config
    from rlbus.logview import events

    trainer_sets = sets + ["trainer.checkpoint_every=0",
                           f"trainer.total_steps={steps + 1}", f"trainer.micro_batch={micro_batch}",
                           f"trainer.shared_prompt={shared_prompt}", "trainer.autocast=auto",
                           "sync.sync_interval=1", f"model.path={model}", *extra]
    if not world:
        from rlbus.trainer.main import Trainer

        trainer = Trainer(load_config(None, trainer_sets, environ={}), model)
        with capture_logs() as logs:
            trainer.run(max_steps=steps + 1)
        return logs
    log = tmp / "trainer.jsonl"
    argv = [sys.executable, "-m", "rlbus.cli", "trainer"]
    for item in trainer_sets + ([f"trainer.threads={len(cores)}"] if cores else []) + [
            f"trainer.world_size={world}", "logging.level=info", "logging.format=json", f"logging.file={log}"]:
        argv += ["--set", item]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
    seen: dict[int, float] = {}  # thread id -> CPU seconds, the last read before the process ended
    children = 0.0
    try:
        while proc.poll() is None:
            threads, waited = thread_cpu(proc.pid)
            seen.update(threads)
            children = max(children, waited)
            time.sleep(0.25)
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, argv)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    main = seen.pop(proc.pid, 0.0)
    return events(log) + [{"event": "process_cpu", "main_s": main, "other_threads_s": sum(seen.values()),
                           "children_s": children}]


def serving_cost(model: str, steps: int, fetchers: int, rounds: int, whole: bool = True,
                 extra: list[str] = (), groups: int = GROUPS) -> dict:
    """The trainer's step time on its own cores while `fetchers` clients fetch every version (deltas, then,
    with `whole`, deltas built at normal priority and whole versions only) against nobody fetching; `rounds`
    alternations, steps paired by index (step i trains the same batch in every run)."""
    variants = (("baseline", 0, []), ("deltas", fetchers, []),
                *([("deltas_normal", fetchers, ["sync.serve_delta_priority=normal"]),
                   ("whole", fetchers, ["sync.serve_deltas=false"])] if whole else []),
                ("mirror", fetchers, []), *([("mirror_deltas", fetchers, [])] if whole else []))
    steps_of: dict[str, list[list[dict]]] = {name: [] for name, _, _ in variants}
    fetched_of: dict[str, list] = {name: [] for name, _, _ in variants}
    cpu_of: dict[str, list] = {name: [] for name, _, _ in variants}
    for r in range(rounds):
        for name, n, more in variants:
            got, published = run_variant(model, steps, True, 32, world=1, extra=[*extra, *more],
                                         fetched=fetched_of[name], fetchers=n, groups=groups,
                                         mirror={"mirror": "whole", "mirror_deltas": "deltas"}.get(name, ""),
                                         cpu=cpu_of[name])
            summarize(f"round {r + 1} {name} ({n} fetching)", got, published)
            steps_of[name].append(got)
    base = [e["step_s"] for run in steps_of["baseline"] for e in run]
    out: dict = {"fetchers": fetchers, "rounds": rounds, "baseline_mean_step_s": round(statistics.mean(base), 3)}
    for name in ("deltas", "deltas_normal", "whole", "mirror", "mirror_deltas") if whole else ("deltas", "mirror"):
        mine = [e["step_s"] for run in steps_of[name] for e in run]
        paired = [m / b - 1 for m, b in zip(mine, base)]
        got = fetched_of[name]
        out[name] = {"mean_step_s": round(statistics.mean(mine), 3),
                     "step_slowdown": round(sum(mine) / sum(base) - 1, 4),
                     "median_paired_slowdown": round(statistics.median(paired), 4),
                     "versions_fetched": len(got), "deltas_fetched": sum(1 for f in got if f["base"]),
                     "median_fetch_s": round(statistics.median(f["seconds"] for f in got), 3) if got else None}
        # The trainer's CPU beside its training thread (its other threads and its delta builders), over the
        # baseline's, per step: what serving took from its core, free of the step times' noise.
        runs = len(cpu_of[name]) * (steps + 1)
        extra_cpu = (sum(c["other_threads_s"] + c["children_s"] for c in cpu_of[name])
                     - sum(c["other_threads_s"] + c["children_s"] for c in cpu_of["baseline"])) / runs
        out[name]["serving_cpu_s_per_step"] = round(extra_cpu, 4)
        out[name]["serving_cpu_share"] = round(extra_cpu / statistics.mean(base), 4)
        out[name]["training_thread_cpu_change"] = round(
            sum(c["main_s"] for c in cpu_of[name]) / sum(c["main_s"] for c in cpu_of["baseline"]) - 1, 4)
        print(f"serving {fetchers} fetch clients ({name}): trainer steps {out[name]['step_slowdown']:+.1%} "
              f"(median of paired steps {out[name]['median_paired_slowdown']:+.1%}), {len(got)} versions fetched; "
              f"serving CPU on the trainer's core {extra_cpu:.3f} s per step "
              f"({out[name]['serving_cpu_share']:.1%} of a step), its training thread's CPU "
              f"{out[name]['training_thread_cpu_change']:+.1%}")
    out["step_slowdown"] = out["deltas"]["step_slowdown"]
    return out


def summarize(name: str, steps: list[dict], published: list[dict]) -> dict:
    step_s = sum(e["step_s"] for e in steps)
    compute_s = sum(e["compute_s"] for e in steps)
    tokens = sum(e["tokens"] for e in steps)
    for e in steps:
        print(f"{name} step {e['step']}: {e['tokens']} trained tokens ({e['forward_tokens']} forwarded), "
              f"compute {e['compute_s']:.2f} s, wait {e['wait_s']:.3f} s, publish {e['publish_s']:.3f} s, "
              f"step {e['step_s']:.2f} s")
    figures = {"tokens_per_s": round(tokens / compute_s, 1),
               "mean_compute_s": round(compute_s / len(steps), 3),
               "non_compute_share": round((step_s - compute_s) / step_s, 4),
               "forward_tokens_per_step": round(sum(e["forward_tokens"] for e in steps) / len(steps)),
               "mean_step_s": round(step_s / len(steps), 2),
               "mean_wait_s": round(sum(e["wait_s"] for e in steps) / len(steps), 3),
               "mean_publish_s": round(sum(e["publish_s"] for e in steps) / len(steps), 3)}
    if published:
        figures["mean_publish_total_s"] = round(sum(e["seconds"] for e in published) / len(published), 3)
    print(f"{name}: {figures['tokens_per_s']} trained tokens/s, compute {figures['mean_compute_s']} s"
          f" per step; {figures['non_compute_share']:.3%} of step time outside compute")
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=at_least(1), default=6)
    ap.add_argument("--model", default="smollm2-135m", help="bundled model name or a model directory")
    ap.add_argument("--world-size", type=at_least(0), default=0,
                    help="also run `rlbus trainer` at world size 1 and at this many ranks (FSDP2), and compare")
    ap.add_argument("--serve", type=at_least(0), default=0, metavar="N",
                    help="also measure the trainer's step time while N clients fetch every version it publishes")
    ap.add_argument("--serve-rounds", type=at_least(1), default=2, metavar="R",
                    help="--serve: alternations of the runs without and with clients (default 2)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every trainer run (e.g. trainer.device=cuda)")
    ap.add_argument("--smoke", action="store_true",
                    help="one timed step of one prompt, world size 1 not run apart: checks that the benchmark "
                         "runs")
    args = ap.parse_args()
    groups = 1 if args.smoke else GROUPS
    if args.smoke:
        args.steps = 1
    if args.world_size == 1 or args.world_size < 0:
        ap.error("--world-size: 2 or more (world size 1 is always run beside it)")
    if args.serve_rounds < 1:
        ap.error("--serve-rounds: 1 or more")
    if args.serve < 0 or (args.serve and len(os.sched_getaffinity(0)) < 2):
        ap.error("--serve: a number of fetch clients, on a host with 2 or more cores (the trainer gets half)")

    from rlbus.weights.models import resolve_model

    model = str(resolve_model(args.model))
    figures = {}
    for name, shared, micro in (("rows", False, 8), ("shared_prompt", True, 32)):
        figures[name] = summarize(name, *run_variant(model, args.steps, shared, micro, extra=args.sets,
                                                            groups=groups))
    speedup = figures["shared_prompt"]["tokens_per_s"] / figures["rows"]["tokens_per_s"]
    print(f"shared-prompt training: {speedup:.2f}x the trained tokens/s of one row per sample")
    out = {"tokens_per_s": figures["shared_prompt"]["tokens_per_s"], "sets": args.sets,
           "non_compute_share": figures["shared_prompt"]["non_compute_share"],
           "ratio_to_rows": round(speedup, 3), "steps": args.steps, **figures}
    if args.world_size:
        # Micro-batches of 8: at world size N each rank trains its share of the batch's 4.
        ranks = {str(w): summarize(f"world_size {w}", *run_variant(model, args.steps, True, 8, world=w,
                                                                   extra=args.sets, groups=groups))
                 for w in ((args.world_size,) if args.smoke else (1, args.world_size))}
        if args.smoke:  # a trainer start fewer: the in-process run stands for world size 1
            ranks["1"] = figures["shared_prompt"]
        ratio = ranks[str(args.world_size)]["tokens_per_s"] / ranks["1"]["tokens_per_s"]
        print(f"world size {args.world_size}: {ratio:.2f}x the trained tokens/s of world size 1")
        out["ranks"] = {**ranks, "ratio_to_world_size_1": round(ratio, 3)}
    if args.serve:
        # The smoke leaves out whole versions: the same path with deltas off.
        out["serving"] = serving_cost(model, args.steps, args.serve, 1 if args.smoke else args.serve_rounds,
                                      whole=not args.smoke, extra=args.sets, groups=groups)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

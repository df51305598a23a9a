"""Weight sync on the bundled model: broadcast (gloo) and checkpoint, from PUBLISH until K explorers can generate.

    .venv/bin/python benchmarks/weight_sync.py [--versions 3]

A real broker and K real `rlbus explorer` processes (vLLM, CPU) in lockstep,
so each waits for the next version. This process plays the trainer: it
holds SmolLM2-135M-Instruct, changes it a little for each version, snapshots
it (not timed, as in the trainer) and publishes it, through the broadcast
publisher (the explorers are members of its epoch) or as a checkpoint. The
sync time of a version runs from the start of publishing to the last
explorer's `weights_loaded` line for it: after that line the explorer's next
generation uses the version. K = 1, then a second explorer joins (K = 2).

Floors, measured in the same run on the same bytes:
- bare_broadcast_s: the buckets broadcast by gloo between plain processes;
- memcpy_s: one copy of the buckets in memory;
- reload_s: vLLM's in-place reload alone (timed inside the explorers' workers).

Last line: one JSON object with broadcast_sync_s, checkpoint_sync_s,
bare_broadcast_s, reload_s, memcpy_s, ratio (broadcast_sync_s over
bare_broadcast_s + reload_s) for K = 1, and the same under `k2`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import REPO, broker_process, free_port  # noqa: E402


def bare_receiver(ann: dict, rank: int, rounds: int, ready) -> None:
    from rlbus.weights.broadcast import Layout, epoch_store, make_comm

    store, _ = epoch_store(ann["address"], ann["epoch"], 120)
    store.wait(["layout"])
    layout = Layout.from_bytes(store.get("layout"))
    comm = make_comm("gloo", store, rank, ann["world"], 120, "127.0.0.1")
    buckets = layout.allocate()
    for _ in range(rounds):
        ready.put(rank)
        for b in buckets:
            comm.broadcast(b)
    comm.close()


def bare_broadcast(layout, buckets, k: int, rounds: int = 3) -> float:
    """Median seconds to broadcast every bucket from rank 0 to k plain processes (gloo, loopback)."""
    from rlbus.weights.broadcast import epoch_store, make_comm, serve_store

    store, port = serve_store("127.0.0.1", 0, 120)
    ann = {"address": f"127.0.0.1:{port}", "epoch": 1000 + k, "world": k + 1}
    kv, _ = epoch_store(ann["address"], ann["epoch"], 120, store=store)
    kv.set("layout", layout.to_bytes())
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    procs = [ctx.Process(target=bare_receiver, args=(ann, r, rounds, ready), daemon=True) for r in range(1, k + 1)]
    for p in procs:
        p.start()
    comm = make_comm("gloo", kv, 0, k + 1, 120, "127.0.0.1")
    times = []
    for _ in range(rounds):
        for _ in range(k):
            ready.get(timeout=120)
        started = time.perf_counter()
        for b in buckets:
            comm.broadcast(b)
        times.append(time.perf_counter() - started)
    comm.close()
    for p in procs:
        p.join(30)
    return statistics.median(times)


def memcpy(buckets) -> float:
    import torch

    copies = [torch.empty_like(b) for b in buckets]
    times = []
    for _ in range(5):
        started = time.perf_counter()
        for c, b in zip(copies, buckets):
            c.copy_(b)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


class Fleet:
    def __init__(self, broker: str, pub_port: int, model: str, logs: Path):
        self.broker, self.pub_port, self.model, self.logs = broker, pub_port, model, logs
        self.procs: list[subprocess.Popen] = []

    def add(self, name: str) -> None:
        args = [sys.executable, "-m", "rlbus.cli", "explorer", "--broker", self.broker, "--name", name]
        for s in (f"broker.pub_port={self.pub_port}", f"model.path={self.model}", "explorer.memory_fraction=0.15",
                  "rollout.max_tokens=4", "explorer.tasks_per_lease=1", "logging.format=json",
                  f"logging.file={self.logs / name}.jsonl"):
            args += ["--set", s]
        self.procs.append(subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL,
                                           stderr=open(self.logs / f"{name}.err", "w"), start_new_session=True))

    def loaded_at(self, name: str, version: int) -> dict | None:
        path = self.logs / f"{name}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            if '"weights_loaded"' in line:
                e = json.loads(line)
                if e.get("policy_version") == version:
                    return e
        return None

    def stop(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=3, help="versions timed per method and K")
    ap.add_argument("--model", default="smollm2-135m", help="bundled model name or a model directory")
    ap.add_argument("--max-k", type=int, default=2, help="explorers at the most (1 or 2)")
    ap.add_argument("--smoke", action="store_true", help="one version per method, one explorer")
    args = ap.parse_args()
    if args.smoke:
        args.versions, args.max_k = 1, 1

    import torch
    from transformers import AutoModelForCausalLM

    from rlbus.common.client import BrokerClient
    from rlbus.common.config import load_config
    from rlbus.weights.models import resolve_model
    from rlbus.weights.broadcaster import BroadcastSender
    from rlbus.weights.checkpoint import CheckpointSender

    model_dir = resolve_model(args.model)
    root = Path(tempfile.mkdtemp(prefix="rlbus-wsync-"))
    logs = root / "logs"
    logs.mkdir()
    port, pub_port = free_port(), free_port()
    sets = [f"broker.port={port}", f"broker.pub_port={pub_port}", "broker.host=127.0.0.1",
            f"buffer.dir={root / 'buffer'}", f"run.dir={root}", "sync.sync_style=lockstep", "sync.sync_interval=1",
            "sync.sync_offset=0", "sync.sync_method=nccl", "data.batch_tasks=1", "rollout.repeat=2", "rollout.max_tokens=4",
            "logging.format=json", f"logging.file={logs / 'broker.jsonl'}"]
    cfg = load_config(None, ["sync.sync_method=nccl", "sync.broadcast_backend=gloo", "sync.sync_timeout_s=120"],
                      environ={})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    files = CheckpointSender(root / "weights", model_dir, dtype=torch.bfloat16)
    pub = BroadcastSender(cfg, files, dtype=torch.bfloat16)
    results: dict = {}
    with broker_process(sets, root / "buffer"):
        trainer = BrokerClient(f"tcp://127.0.0.1:{port}", "trainer", "bench", heartbeat_interval_s=0.5)
        trainer.start(30)
        pub.attach(trainer)
        fleet = Fleet(f"tcp://127.0.0.1:{port}", pub_port, args.model, logs)
        version = 0
        try:
            for k in range(1, args.max_k + 1):
                fleet.add(f"explorer-{k}")
                names = [f"explorer-{i}" for i in range(1, k + 1)]
                deadline = time.monotonic() + 300
                while not set(names) <= {p["name"] for p in trainer.request("STATUS").header["peers"]}:
                    if time.monotonic() > deadline or any(p.poll() is not None for p in fleet.procs):
                        raise RuntimeError(f"explorers did not connect; see {logs}")
                    time.sleep(0.2)
                time.sleep(3)  # let the newcomer load the current version and settle into waiting
                row: dict = {"broadcast": [], "checkpoint": [], "reload": []}
                for method in ("broadcast", "checkpoint"):
                    publisher = pub if method == "broadcast" else files
                    for _ in range(args.versions):
                        version += 1
                        with torch.no_grad():
                            model.model.norm.weight.add_(1e-3)
                        snapshot = publisher.snapshot(model)
                        started = time.time()
                        state = publisher.publish(snapshot, version, version - 1)
                        trainer.request("PUBLISH", state)
                        deadline = time.monotonic() + 120
                        while not all(fleet.loaded_at(n, version) for n in names):
                            if time.monotonic() > deadline:
                                raise RuntimeError(f"version {version} was not loaded by all of {names}; see {logs}")
                            time.sleep(0.01)
                        events = [fleet.loaded_at(n, version) for n in names]
                        row[method].append(max(e["ts"] for e in events) - started)
                        if method == "broadcast":
                            row["reload"] += [e["reload_s"] for e in events if "reload_s" in e]
                        print(f"K={k} {method} v{version}: {row[method][-1]:.3f} s", file=sys.stderr, flush=True)
                        time.sleep(2)  # the explorer that got the batch finishes its rollout
                layout, buckets = pub.layout, pub.snapshot(model)[1]
                bare = bare_broadcast(layout, buckets, k)
                fig = {"broadcast_sync_s": round(statistics.median(row["broadcast"]), 3),
                       "checkpoint_sync_s": round(statistics.median(row["checkpoint"]), 3),
                       "bare_broadcast_s": round(bare, 3),
                       "reload_s": round(statistics.median(row["reload"]), 3),
                       "memcpy_s": round(memcpy(buckets), 3), "bytes": layout.nbytes,
                       "broadcast_runs_s": [round(x, 3) for x in row["broadcast"]],
                       "checkpoint_runs_s": [round(x, 3) for x in row["checkpoint"]]}
                fig["ratio"] = round(fig["broadcast_sync_s"] / (fig["bare_broadcast_s"] + fig["reload_s"]), 3)
                print(f"K={k}: {json.dumps(fig)}", flush=True)
                results[k] = fig
        finally:
            fleet.stop()
            trainer.close(bye=True)
            pub.close()
    out = dict(results[1])
    out["k2"] = results.get(2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

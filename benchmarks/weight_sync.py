"""Weight sync on the bundled model: broadcast (gloo), checkpoint and network fetch (whole and delta),
from PUBLISH until K explorers can generate.

    .venv/bin/python benchmarks/weight_sync.py [--versions 3] [--max-k 4] [--link-mbit R] [--no-overlap]

A real broker and K real `rlbus explorer` processes (vLLM, CPU) in lockstep,
so each waits for the next version. This process plays the trainer: it
holds SmolLM2-135M-Instruct in float32 and changes it as an Adam step of
`--lr` would (every value moves by about lr), snapshots it (not timed, as in
the trainer) and publishes it in bfloat16: through the broadcast publisher
(the explorers are members of its epoch), as a checkpoint read by path, or
served by a WeightServer with the path made unreadable to the explorers (as
on a separate host): first whole versions, then deltas against the version
each explorer holds (built at normal priority, and the explorers wait for
each build, `explorer.delta_wait_s`, where by default they would take a
whole version that comes sooner). The sync time of a version runs from the
start of publishing to the last explorer's `weights_loaded` line for it:
after that line the explorer's next generation uses the version. K = 1, 2,
4: explorers join one by one.

Floors, measured in the same run on the same bytes:
- bare_broadcast_s: the buckets broadcast by gloo between plain processes;
- memcpy_s: one copy of the buckets in memory;
- reload_s: vLLM's in-place reload alone (timed inside the explorers' workers);
- file_reload_s: the same reload from a checkpoint read by path;
- loopback_mb_s: a plain TCP stream over loopback between two threads;
  network floor = version bytes / loopback_mb_s + file_reload_s: the transfer, then the reload.

From its second fetched version on, an explorer reloads while the fetch
arrives (`explorer.overlap_fetch`, weights/stream.py), so a fetch can come
under that floor; `--no-overlap` turns that off, for a baseline. An
explorer's first fetched version is the one it starts a run with: nothing
fetched before to reload beside or to fall back on, no older copy to write
over. Before the timed whole versions, each K publishes one such version;
its time is network_first_from_publish_s, apart from the steady state that
network_ratio measures.

Last line: one JSON object with, for K = 1, broadcast_sync_s,
checkpoint_sync_s, network_full_sync_s, network_delta_sync_s (from the start
of publishing, which for the file methods includes writing the version),
network_full_from_publish_s and network_delta_from_publish_s (from the
PUBLISH request), network_first_from_publish_s,
bare_broadcast_s, reload_s, memcpy_s, network_floor_s, ratio (broadcast over
its floor), network_ratio (network_full_from_publish_s over network_floor_s),
delta_bytes_share (delta bytes over version bytes, median), delta_apply_s,
server_cpu_s (the weight server's CPU time per version served to every
explorer, the share of the trainer's process it takes), file_reload_s,
overlapped_loads (network loads that reloaded while fetching), and
loopback_mb_s, or link_mb_s with `--link-mbit` (which leaves out the
broadcast and its floors: its rendezvous is on loopback); the same under
`k2` and `k4`.
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
from contextlib import nullcontext
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import REPO, at_least, broker_process  # noqa: E402
from benchmarks.links import LINK, link, link_mb_s, loopback_mb_s  # noqa: E402
from rlbus.common.processes import terminate_with  # noqa: E402
from rlbus.logview import events  # noqa: E402


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


def adam_like_step(model, lr: float, generator) -> None:
    """Move every parameter by about lr, as Adam's normalised update does."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator).sign_(), alpha=lr)


class Fleet:
    def __init__(self, broker: str, pub_port: int, model: str, logs: Path, fetch_dir: str = "",
                 sets: list[str] | None = None, namespace: str | None = None):
        self.broker, self.pub_port, self.model, self.logs = broker, pub_port, model, logs
        self.fetch_dir = fetch_dir
        self.sets = sets or []
        self.prefix = ["ip", "netns", "exec", namespace] if namespace else []
        self.procs: list[subprocess.Popen] = []

    def add(self, name: str) -> None:
        args = [*self.prefix, sys.executable, "-m", "rlbus.cli", "explorer", "--broker", self.broker, "--name", name]
        for s in (f"broker.pub_port={self.pub_port}", f"model.path={self.model}", f"run.dir={self.logs.parent}",
                  "explorer.kv_cache_mb=256", "rollout.max_tokens=4", "explorer.tasks_per_lease=1",
                  "logging.format=json",
                  f"logging.file={self.logs / name}.jsonl",
                  *([f"explorer.weights_dir={self.fetch_dir}/{name}"] if self.fetch_dir else []), *self.sets):
            args += ["--set", s]
        # A group of its own (stop() ends it whole), and SIGTERM when this benchmark dies, even by SIGKILL: an
        # explorer left behind waits for its broker for ever, holding its engine's memory.
        self.procs.append(subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL,
                                           stderr=open(self.logs / f"{name}.err", "w"), start_new_session=True,
                                           preexec_fn=partial(terminate_with, os.getpid())))

    def loaded_at(self, name: str, version: int, event: str = "weights_loaded") -> dict | None:
        return next((e for e in events(self.logs / f"{name}.jsonl", event) if e.get("policy_version") == version),
                    None)

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


def publish_one(publisher, model, version: int, trainer, fleet: "Fleet", names: list[str], args,
                hide_path: bool = False) -> tuple[float, float, list[dict]]:
    """Step, snapshot, publish one version. Seconds from the start of publishing and from the PUBLISH request
    until every explorer in `names` loaded it, and their lines."""
    adam_like_step(model, args.lr, args.generator)
    snapshot = publisher.snapshot(model)
    started = time.time()
    state = publisher.publish(snapshot, version, version - 1)
    if hide_path:  # as on a separate host: the explorers cannot read the trainer's directory, so they fetch
        state["location"] = "/separate-host" + state["location"]
    announced = time.time()
    trainer.request("PUBLISH", state)
    deadline = time.monotonic() + 180
    # A fetch that overlaps its reload logs `weights_fetched` after `weights_loaded`: wait for both lines.
    wanted = ("weights_loaded", "weights_fetched") if hide_path else ("weights_loaded",)
    while not all(fleet.loaded_at(n, version, event) for n in names for event in wanted):
        if time.monotonic() > deadline:
            raise RuntimeError(f"version {version} was not loaded by all of {names}; see {fleet.logs}")
        time.sleep(0.1)  # the explorers' lines carry the time; polling often would take CPU from the weight server
    loads = [fleet.loaded_at(n, version) for n in names]
    done = max(e["ts"] for e in loads)
    return done - started, done - announced, loads


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=at_least(1), default=3, help="versions timed per method and K")
    ap.add_argument("--model", default="smollm2-135m", help="bundled model name or a model directory")
    ap.add_argument("--max-k", type=int, default=4, choices=(1, 2, 4), help="explorers at the most")
    ap.add_argument("--lr", type=float, default=1e-5, help="the size of each simulated Adam step")
    ap.add_argument("--fetch-dir", default="", help="where explorers keep fetched versions (default: their run "
                                                     "directory, a temporary one on the disk the trainer writes to)")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (weights, logs) after the run")
    ap.add_argument("--smoke", action="store_true", help="one version per method, one explorer")
    ap.add_argument("--link-mbit", type=float, default=0,
                    help="explorers on a host of their own behind a link of this many Mbit/s (a network namespace; "
                         "needs root), with the checkpoint and network methods only; 0: all on loopback")
    ap.add_argument("--no-overlap", action="store_true",
                    help="explorers reload only once a fetch is complete (explorer.overlap_fetch=false)")
    args = ap.parse_args()
    if args.smoke:
        args.versions, args.max_k = 1, 1
    with link(args.link_mbit) if args.link_mbit else nullcontext() as namespace:
        run(args, namespace)


def run(args, namespace: str | None) -> None:
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from rlbus.common.client import BrokerClient
    from rlbus.common.config import load_config
    from rlbus.weights.broadcaster import BroadcastSender
    from rlbus.weights.checkpoint import CheckpointSender
    from rlbus.weights.models import resolve_model
    from rlbus.weights.server import WeightServer

    args.generator = torch.Generator().manual_seed(0)
    model_dir = resolve_model(args.model)
    root = Path(tempfile.mkdtemp(prefix="rlbus-wsync-"))
    logs = root / "logs"
    logs.mkdir()
    host = LINK[0] if namespace else "127.0.0.1"
    sets = [f"broker.host={host}",
            f"buffer.dir={root / 'buffer'}", f"run.dir={root}", "sync.sync_style=lockstep", "sync.sync_interval=1",
            "sync.sync_offset=0", "sync.sync_method=nccl", "data.batch_tasks=1", "rollout.repeat=2",
            "rollout.max_tokens=4", "logging.format=json", f"logging.file={logs / 'broker.jsonl'}"]
    cfg = load_config(None, ["sync.sync_method=nccl", "sync.broadcast_backend=gloo", "sync.sync_timeout_s=120"],
                      environ={})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    files = CheckpointSender(root / "weights", model_dir, dtype=torch.bfloat16)
    pub = BroadcastSender(cfg, files, dtype=torch.bfloat16)
    # Deltas at normal priority: the delta row measures the delta path, not how much CPU this host has to spare.
    server = WeightServer(root / "served", host, deltas=False, delta_priority="normal", map_files=True).start()
    served = CheckpointSender(root / "served", model_dir, dtype=torch.bfloat16, server=server)
    publishers = {"broadcast": pub, "checkpoint": files, "network_full": served, "network_delta": served}
    if namespace:  # the broadcast's rendezvous is on loopback
        del publishers["broadcast"]
    results: dict = {}
    with broker_process(sets, root / "buffer") as broker:
        trainer = BrokerClient(f"tcp://{host}:{broker.port}", "trainer", "bench", heartbeat_interval_s=0.5)
        trainer.start(30)
        pub.attach(trainer)
        fleet = Fleet(f"tcp://{host}:{broker.port}", broker.pub_port, args.model, logs, args.fetch_dir,
                      # The delta row measures deltas: explorers wait for each build whatever a whole version takes.
                      [f"explorer.overlap_fetch={not args.no_overlap}", "explorer.delta_wait_s=60"], namespace)
        version = 0
        try:
            for k in (1, 2, 4):
                if k > args.max_k:
                    break
                while len(fleet.procs) < k:
                    fleet.add(f"explorer-{len(fleet.procs) + 1}")
                names = [f"explorer-{i}" for i in range(1, k + 1)]
                deadline = time.monotonic() + 300
                while not set(names) <= {p["name"] for p in trainer.request("STATUS").header["peers"]}:
                    if time.monotonic() > deadline or any(p.poll() is not None for p in fleet.procs):
                        raise RuntimeError(f"explorers did not connect; see {logs}")
                    time.sleep(0.2)
                time.sleep(3)  # let the newcomers load the current version and settle into waiting
                row: dict = {m: [] for m in publishers} | {"reload": [], "file_reload": [], "share": [],
                                                           "apply": [], "cpu": [], "overlapped": 0, "first": []}
                for method, publisher in publishers.items():
                    network = method.startswith("network")
                    server.manifests.deltas = method == "network_delta"
                    if method == "network_full":  # each explorer's first fetch, timed apart (see the docstring)
                        version += 1
                        row["first"].append(publish_one(publisher, model, version, trainer, fleet, names, args,
                                                        hide_path=True)[1])
                        time.sleep(2)
                    for _ in range(args.versions):
                        version += 1
                        cpu = server.cpu_s
                        seconds, after_publish, loads = publish_one(publisher, model, version, trainer, fleet, names,
                                                                    args, hide_path=network)
                        row[method].append(seconds)
                        row.setdefault(method + "_from_publish", []).append(after_publish)
                        if method == "broadcast":
                            row["reload"] += [e["reload_s"] for e in loads if "reload_s" in e]
                        if method == "checkpoint":
                            row["file_reload"] += [e["reload_s"] for e in loads if "reload_s" in e]
                        if network:
                            row["overlapped"] += sum(e["method"] == "stream" for e in loads)
                            row["cpu"].append(server.cpu_s - cpu)
                            fetches = [fleet.loaded_at(n, version, "weights_fetched") for n in names]
                            if method == "network_delta":
                                row["share"] += [f["bytes"] / f["version_bytes"] for f in fetches if f["base"]]
                                row["apply"] += [f["apply_s"] for f in fetches if f["base"]]
                        print(f"K={k} {method} v{version}: {seconds:.3f} s", file=sys.stderr, flush=True)
                        time.sleep(2)  # the explorer that got the batch finishes its rollout
                version_bytes = sum(f.stat().st_size for f in (root / "served" / f"v{version}").iterdir())
                fig = {m + "_sync_s": median(row[m]) for m in publishers}
                fig |= {m + "_from_publish_s": median(row[m + "_from_publish"]) for m in publishers if "network" in m}
                fig["network_first_from_publish_s"] = median(row["first"])
                fig |= {"version_bytes": version_bytes,
                        "delta_bytes_share": round(statistics.median(row["share"]), 4) if row["share"] else None,
                        "delta_apply_s": median(row["apply"]), "server_cpu_s": median(row["cpu"]),
                        "file_reload_s": median(row["file_reload"]), "overlapped_loads": row["overlapped"]}
                if namespace:
                    fig["link_mb_s"] = round(link_mb_s(namespace, version_bytes), 1)
                else:
                    fig["loopback_mb_s"] = round(loopback_mb_s(version_bytes), 1)
                if "broadcast" in publishers:
                    layout, buckets = pub.layout, pub.snapshot(model)[1]
                    fig |= {"bare_broadcast_s": round(bare_broadcast(layout, buckets, k), 3),
                            "reload_s": median(row["reload"]), "memcpy_s": round(memcpy(buckets), 3),
                            "bytes": layout.nbytes}
                    fig["ratio"] = round(fig["broadcast_sync_s"] / (fig["bare_broadcast_s"] + fig["reload_s"]), 3)
                rate = fig.get("link_mb_s") or fig["loopback_mb_s"]
                fig["network_floor_s"] = round(version_bytes / 1e6 / rate + fig["file_reload_s"], 3)
                fig["network_ratio"] = round(fig["network_full_from_publish_s"] / fig["network_floor_s"], 3)
                fig |= {m + "_runs_s": [round(x, 3) for x in row[m]] for m in publishers}
                print(f"K={k}: {json.dumps(fig)}", flush=True)
                results[k] = fig
        finally:
            fleet.stop()
            trainer.close(bye=True)
            pub.close()
            served.close()
    out = dict(results[1])
    out["k2"], out["k4"] = results.get(2), results.get(4)
    if not args.keep:  # (kept when the run failed: its logs say why)
        shutil.rmtree(root, ignore_errors=True)
        if args.fetch_dir:
            shutil.rmtree(args.fetch_dir, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

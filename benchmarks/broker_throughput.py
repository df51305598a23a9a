"""Durable broker throughput beside raw ZeroMQ, measured in the same run.

P producer processes PUT trajectories of 1024 response tokens (int32 ids and
float32 logprobs plus a 128-token prompt, ~8.8 KB as msgpack) through a real
broker process (SQLite WAL metadata, append-only payload segments,
fdatasync per group commit) to a consumer that FETCHes a batch of 64
groups a step and COMMITs every 10 steps, as a trainer with its default
`checkpoint_every` does (each producer's groups labelled in explorer
batches of 64, as an explorer's tasks come). Then the same producers push
the same messages over a bare PUSH/PULL pair: the ceiling.

A second case stores large trajectories (256 KB of opaque payload each,
`--large-kb`; 8 per PUT, `--large-window` PUTs in flight), once with nothing
fetched meanwhile (the rate of ACKs, each durable) and once to a consumer,
and compares the MB/s with this disk's own sequential write rate with one
fdatasync per write (the best of buffered writes and O_DIRECT ones, as the
broker makes, the size of one PUT and of every PUT in flight at once: the
largest group commit), measured in the same run in the same directory, and
with the same messages relayed by a bare ZeroMQ process (PULL to PUSH,
nothing stored): the two socket hops every trajectory makes through the
broker, on the same cores. Beside them, the broker's storage alone: its
`Store` in this process writing the same PUTs, already in memory, a group
commit of every PUT in flight at once (no socket, no producer).

The two target ratios are measured in rounds (`--rounds`, 3 by default),
each round the ratio's two cases back to back: one-per-message ZeroMQ and
the broker, first one then the other in turn; the disk, in the kind of
write that was fastest at the start, then the ingest. The figure is the
median round's ratio (of an even count, the lower of the middle two, so
that it is always one round's): this host's cores and disk change speed
within seconds (docs/architecture.md, *Measuring on this host*).

    python benchmarks/broker_throughput.py [--quick] [--producers P] [--rounds R]

The last line printed is one JSON object: broker_traj_per_s,
raw_zmq_traj_per_s, ratio, ratio_to_per_message (the median round's; the
broker's figures are of that round) and ratio_to_per_message_rounds (every
round's), small_disk_mb_per_s (this
disk's rate of fdatasync'd writes the size of the small case's largest group
commit, as many bytes as it stored), small_ratio_to_disk (the payload bytes
the broker made durable a second, against it) and
small_disk_bound_ratio_to_per_message (the rate that disk allows any broker
that writes every payload, against one-per-message ZeroMQ: where it is under
0.5, so is ratio_to_per_message), p50_ack_ms, p99_ack_ms,
producers_done_s and consumer_done_s (when the producers had their last ACK
and when the consumer had the last trajectory: a gap is a consumer that fell
behind), large_window, large_ingest_mb_per_s, large_mb_per_s (to a
consumer), disk_fdatasync_mb_per_s (the best of disk_buffered_mb_per_s and
disk_direct_mb_per_s), large_ingest_ratio_to_disk (the median round's,
against the disk timed in that round; large_ingest_mb_per_s is that round's
too) and large_ingest_rounds (each round's disk, ingest and ratio),
large_ratio_to_disk,
large_store_alone_mb_per_s, large_store_alone_ratio_to_disk,
large_ingest_cpu_bound_mb_per_s and its ratio to the disk (the most the
cores could carry at the CPU per byte the producers and the broker spent
in the ingest case, were they busy every moment),
large_relay_mb_per_s, large_ratio_to_relay, put_decode_us and
put_decode_general_us (one PUT header decoded and validated by the broker's
one-pass path and by the general path alone, timed in this process), the CPU
seconds per 10,000 trajectories of each side (producers, broker, consumer)
in the one-per-message ZeroMQ case and through the broker, and the settings.
On a machine with few cores every side competes for them: the CPU figures
say where the time goes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.broker_data import (BATCH_GROUPS, GROUP, decode_us, make_batch, sample_payload,  # noqa: E402
                                    store_alone_mb_per_s)
from benchmarks.harness import (Run, at_least, broker_process, by_role, cpu_seconds, disk_rates,  # noqa: E402
                                relay, thread_cpu_by_role)


def producer(mode: str, address: str, index: int, n_traj: int, per_put: int, window: int, large_kb: int,
             ready, go, results) -> None:
    import zmq

    from rlbus.common import protocol as P

    payload = sample_payload(large_kb)
    groups_per_put = per_put // GROUP
    puts = n_traj // per_put
    batches = [make_batch(index, k * groups_per_put, groups_per_put, payload) for k in range(puts)]
    latencies: list[float] = []
    if mode in ("raw", "raw1"):
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 1000)
        push.connect(address)
        ready.put(index)
        go.wait()
        cpu = time.process_time()
        if mode == "raw":  # the very messages a PUT sends
            for items in batches:
                metas = [dict(m) for m, _ in items]
                frame = P.join_payloads(metas, [p for _, p in items])
                push.send_multipart(P.encode(P.PUT, {"trajectories": metas}, [frame]), copy=False)
        else:  # one trajectory per message, as DESIGN.md's transport figures were measured
            for items in batches:
                for meta, payload in items:
                    push.send_multipart([P.pack(meta), payload], copy=False)
        push.close(linger=-1)
        ctx.term()
        done = time.perf_counter()
    else:
        from rlbus.common.client import BrokerClient

        client = BrokerClient(address, "explorer", f"bench-{index}", max_in_flight=window)
        client.start(30)
        ready.put(index)
        go.wait()
        cpu = time.process_time()
        inflight = []
        for items in batches:
            sent = time.perf_counter()
            fut = client.put_async(items)
            fut.add_done_callback(lambda f, s=sent: latencies.append(time.perf_counter() - s))
            inflight.append(fut)
            if len(inflight) >= window:
                inflight.pop(0).result(120)
        for fut in inflight:
            fut.result(120)
        done = time.perf_counter()  # CLOCK_MONOTONIC: the parent's clock too
        client.close()
    results.put((index, latencies, time.process_time() - cpu, done))


def run_producers(mode: str, address: str, args, consume) -> tuple[float, list[float], float, float]:
    """(seconds, PUT-to-ACK latencies, the producers' CPU seconds, seconds until the last producer was done) of
    one case; the caller's `consume` takes every trajectory."""
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    # Daemons: a case that fails midway ends this process, and its producers with it (not left waiting for ACKs).
    procs = [ctx.Process(target=producer, args=(mode, address, i, args.per_producer, args.per_put, args.window,
                                                args.large_kb, ready, go, results), daemon=True)
             for i in range(args.producers)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=60)
    start = time.perf_counter()
    go.set()
    consume(args.per_producer * args.producers)
    elapsed = time.perf_counter() - start
    latencies: list[float] = []
    cpu, done = 0.0, 0.0
    for _ in procs:
        _, lat, used, end = results.get(timeout=60)
        latencies.extend(lat)
        cpu, done = cpu + used, max(done, end - start)
    for p in procs:
        p.join(30)
    return elapsed, latencies, cpu, done


def bench_raw(args, mode: str = "raw", relayed: bool = False) -> Run:
    """Producers PUSH to the consumer's PULL; `relayed`: through a relay process in between (the two hops
    every trajectory makes through the broker, and nothing else)."""
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    per_message = args.per_put if mode == "raw" else 1
    used: dict[str, float] = {}
    hop = None
    if relayed:
        spawn = mp.get_context("spawn")
        results = spawn.Queue()
        hop = spawn.Process(target=relay, args=(args.per_producer * args.producers // per_message, results))
        hop.start()
    else:
        address = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"

    def consume(total: int) -> None:
        cpu, got = time.process_time(), 0
        while got < total:
            pull.recv_multipart(copy=False)
            got += per_message
        used["consumer"] = time.process_time() - cpu

    try:
        if hop is not None:
            inbound, outbound = results.get(timeout=60)
            address = f"tcp://127.0.0.1:{inbound}"
            pull.connect(f"tcp://127.0.0.1:{outbound}")
        elapsed, _, producers, _ = run_producers(mode, address, args, consume)
        if hop is not None:
            used["relay"] = results.get(timeout=60)
            hop.join(30)
    finally:
        if hop is not None and hop.is_alive():  # a relay that failed midway must not keep this process alive
            hop.terminate()
            hop.join(30)
        pull.close(0)
        ctx.term()
    return Run(args.per_producer * args.producers / elapsed, [], {"producers": producers, **used})


def bench_broker(args, data_dir: Path, fetch: bool = True) -> Run:
    """Producers PUT through a real broker; `fetch`: a consumer FETCHes and COMMITs meanwhile, and the rate
    is taken when it has every trajectory; else none does, and the rate is taken at the last ACK."""
    from rlbus.common import protocol as P
    from rlbus.common.client import BrokerClient

    sets = [f"buffer.dir={data_dir}", f"run.dir={data_dir}", f"buffer.fsync={args.fsync}", "buffer.capacity=1000000",
            "sync.sync_style=async", "sync.max_staleness=1000000", "logging.level=warning", "logging.format=json"]
    with broker_process(sets, data_dir, args.profile) as broker:
        address, pid = broker.address, broker.proc.pid
        trainer = BrokerClient(address, "trainer", "bench-trainer")
        trainer.start(30)

        used: dict[str, float] = {}

        def consume(total: int) -> None:  # as the trainer does: a FETCH a step, a COMMIT per checkpoint and at the end
            cpu, got, step = time.process_time(), 0, 0
            while got < total:
                request = {"step": step, "max_groups": BATCH_GROUPS, "wait_ms": 200}
                reply = trainer.request(P.FETCH, request, timeout=60)
                if reply.command == P.BATCH:
                    got += sum(len(g["trajectories"]) for g in reply.header["groups"])
                    if (step + 1) % args.commit_every == 0 or got >= total:
                        trainer.request(P.COMMIT, {"step": step}, timeout=60)
                    step += 1
            used["consumer"] = time.process_time() - cpu

        cpu_before, threads_before = cpu_seconds(pid), thread_cpu_by_role(pid)
        elapsed, latencies, producers, done = run_producers("broker", address, args,
                                                            consume if fetch else lambda total: None)
        used = {"producers": producers, "broker": cpu_seconds(pid) - cpu_before, **used}
        threads = by_role(threads_before, thread_cpu_by_role(pid))
        trainer.close()
        return Run(args.per_producer * args.producers / (elapsed if fetch else done), latencies, used, done,
                   elapsed, threads)


def median_round(rounds: list[tuple]) -> tuple:
    """The round whose ratio (its first field) is the median; of an even count, the lower middle one."""
    return sorted(rounds, key=lambda r: r[0])[(len(rounds) - 1) // 2]


def bench_large(args, data_dir: Path) -> dict:
    """Large trajectories through the broker, beside the disk's own fdatasync'd write rate."""
    big = argparse.Namespace(**vars(args))
    big.large_kb, big.per_put, big.window = args.large_kb_case, 8, args.large_window
    big.per_producer = (16 if args.smoke else 2400 if args.quick else 8000) // big.per_put * big.per_put
    put_bytes = big.per_put * (big.large_kb << 10)
    total = big.per_producer * big.producers * (big.large_kb << 10)
    # The disk at the size of one PUT and at the most one group commit can take (every PUT in flight), buffered
    # and direct: the best of the four is the baseline.
    blocks = {size: sample_payload(max(1, size >> 10)) for size in (put_bytes, put_bytes * big.window * big.producers)}
    rates = disk_rates(data_dir, blocks, total)
    disk = max(rates.values())
    print("disk, sequential writes with fdatasync each: " + ", ".join(
        f"{size >> 20} MB {'direct' if direct else 'buffered'} {rate:,.1f} MB/s"
        for (size, direct), rate in rates.items()), flush=True)
    n = big.per_producer * big.producers
    alone = store_alone_mb_per_s(data_dir / "alone", sample_payload(big.large_kb), big.per_put, n // big.per_put,
                                 big.window * big.producers)
    print(f"the broker's storage alone (no socket), a group commit of every PUT in flight: {alone:,.1f} MB/s "
          f"({alone / disk:.2f} of the disk)", flush=True)
    raw_run = bench_raw(big)
    raw = raw_run.rate * (big.large_kb << 10) / 1e6
    print(f"raw zmq push/pull, the same {big.large_kb} KB PUT messages: {raw:,.1f} MB/s "
          f"(CPU s per 10k: {raw_run.cpu_line(n)})", flush=True)
    relay_run = bench_raw(big, relayed=True)
    relayed = relay_run.rate * (big.large_kb << 10) / 1e6
    print(f"raw zmq through a relay process (two hops, nothing stored): {relayed:,.1f} MB/s "
          f"(CPU s per 10k: {relay_run.cpu_line(n)})", flush=True)
    # The host's speed and the disk's both drift within seconds (docs/architecture.md, *Measuring on this host*):
    # each round times the disk again, in the kind of write that won above, just before its ingest.
    kind = max(rates, key=rates.get)[1]
    rounds = []
    for r in range(args.rounds):
        disk_now = max(disk_rates(data_dir, blocks, total, (kind,)).values()) or disk
        ingest_run = bench_broker(big, data_dir / f"ingest-{r}", fetch=False)
        shutil.rmtree(data_dir / f"ingest-{r}")
        ingest, bound = ingest_run.rate * (big.large_kb << 10) / 1e6, ingest_run.cpu_bound(total) / 1e6
        rounds.append((ingest / disk_now, disk_now, ingest, bound))
        print(f"round {r + 1}: the disk {disk_now:,.1f} MB/s, then the durable broker, {big.large_kb} KB trajectories, "
              f"nothing fetched meanwhile: {ingest:,.1f} MB/s ACKed ({ingest / disk_now:.2f} of the disk, "
              f"{ingest / raw:.2f} of one raw hop; CPU s per 10k: {ingest_run.cpu_line(n)}); at that CPU per byte, "
              f"{len(os.sched_getaffinity(0))} cores busy every moment would carry {bound:,.1f} MB/s "
              f"({bound / disk_now:.2f} of the disk)", flush=True)
    ingest_ratio, disk_mid, ingest, bound = median_round(rounds)
    if len(rounds) > 1:
        print(f"the ingest, {len(rounds)} rounds: {ingest_ratio:.2f} of the disk at the median (rounds: "
              f"{', '.join(f'{r[0]:.2f}' for r in rounds)})", flush=True)
    run = bench_broker(big, data_dir / "large")
    rate, mb = run.rate, run.rate * (big.large_kb << 10) / 1e6
    print(f"durable broker, {big.large_kb} KB trajectories, to a consumer: {rate:,.1f} traj/s = {mb:,.1f} MB/s "
          f"({mb / disk:.2f} of the disk, {mb / relayed:.2f} of the relay; CPU s per 10k: {run.cpu_line(n)})",
          flush=True)
    return {"large_kb": big.large_kb, "large_window": big.window, "large_traj_per_s": round(rate, 1),
            "large_mb_per_s": round(mb, 1), "disk_fdatasync_mb_per_s": round(disk, 1),
            "disk_buffered_mb_per_s": round(max(r for (_, d), r in rates.items() if not d), 1),
            "disk_direct_mb_per_s": round(max(r for (_, d), r in rates.items() if d), 1),
            "large_ratio_to_disk": round(mb / disk, 3), "large_ingest_mb_per_s": round(ingest, 1),
            "large_ingest_ratio_to_disk": round(ingest_ratio, 3),
            "large_ingest_rounds": [{"disk_mb_per_s": round(d, 1), "ingest_mb_per_s": round(i, 1),
                                     "ratio_to_disk": round(q, 3)} for q, d, i, _ in rounds],
            "large_store_alone_mb_per_s": round(alone, 1),
            "large_store_alone_ratio_to_disk": round(alone / disk, 3),
            "large_ingest_cpu_bound_mb_per_s": round(bound, 1),
            "large_ingest_cpu_bound_ratio_to_disk": round(bound / disk_mid, 3),
            "large_raw_zmq_mb_per_s": round(raw, 1), "large_ratio_to_raw_zmq": round(mb / raw, 3),
            "large_relay_mb_per_s": round(relayed, 1), "large_ratio_to_relay": round(mb / relayed, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short run (about a minute)")
    ap.add_argument("--smoke", action="store_true", help="a few PUTs only: checks that the benchmark runs")
    ap.add_argument("--producers", type=at_least(1), default=2)
    ap.add_argument("--per-put", type=at_least(GROUP, GROUP), default=64, help="trajectories per PUT message")
    ap.add_argument("--window", type=at_least(1), default=8, help="PUTs in flight per producer")
    ap.add_argument("--fsync", choices=["group", "off"], default="group")
    ap.add_argument("--commit-every", type=at_least(0), default=0, help="steps per COMMIT (0: as checkpoint_every)")
    ap.add_argument("--profile", default="", help="write a cProfile of the broker process to this file")
    ap.add_argument("--large-kb", dest="large_kb_case", type=at_least(0), default=256,
                    help="payload of the large-trajectory case, in KB (0: skip that case)")
    ap.add_argument("--large-window", type=at_least(1), default=4, help="PUTs in flight per producer, large case")
    ap.add_argument("--rounds", type=at_least(0), default=0,
                    help="rounds of each ratio's two cases measured back to back; the median round is the figure "
                         "(0: 3, or 2 with --smoke)")
    args = ap.parse_args()
    args.rounds = args.rounds or (2 if args.smoke else 3)
    from rlbus.common.sections import TrainerConfig  # here, not at the top: the producers' processes need none of it
    args.large_kb, args.commit_every = 0, args.commit_every or TrainerConfig().checkpoint_every or 1
    args.per_producer = (4 * args.per_put if args.smoke else 20_000 if args.quick else 100_000) \
        // args.per_put * args.per_put
    n = args.per_producer * args.producers
    payload = sample_payload()  # what each producer sends, built again in its own process
    print(f"payload bytes per trajectory: {len(payload)}", flush=True)
    raw_run = bench_raw(args)
    raw = raw_run.rate
    print(f"raw zmq push/pull, the same PUT messages: {raw:,.0f} traj/s "
          f"(CPU s per 10k: {raw_run.cpu_line(n)})", flush=True)
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-") as tmp:
        # Rounds of the two cases back to back, first one then the other in turn: the host's speed drifts
        # (docs/architecture.md, *Measuring on this host*), so each round's ratio is of two neighbouring runs.
        rounds = []
        for r in range(args.rounds):
            pair = {}
            for case in (("raw1", "broker") if r % 2 == 0 else ("broker", "raw1")):
                pair[case] = bench_raw(args, "raw1") if case == "raw1" else bench_broker(args, Path(tmp) / f"small-{r}")
            shutil.rmtree(Path(tmp) / f"small-{r}")  # outside any timing: unlinking a large file takes a while
            rounds.append((pair["broker"].rate / pair["raw1"].rate, pair["raw1"], pair["broker"]))
            print(f"round {r + 1}: raw zmq push/pull, one trajectory per message: {pair['raw1'].rate:,.0f} traj/s "
                  f"(CPU s per 10k: {pair['raw1'].cpu_line(n)}); durable broker {pair['broker'].rate:,.0f} traj/s: "
                  f"{rounds[-1][0]:.2f} of it", flush=True)
        ratio1, raw1_run, run = median_round(rounds)
        raw1 = raw1_run.rate
        # The disk at the small case's largest group commit (every PUT in flight), as many bytes as it stored:
        # the most trajectories a second any broker that writes each payload could make durable here.
        commit = payload * (args.per_put * args.window * args.producers)
        disk = max(disk_rates(Path(tmp), {len(commit): commit}, n * len(payload)).values())
        large = bench_large(args, Path(tmp)) if args.large_kb_case else {}
    disk_bound = disk * 1e6 / len(payload)
    rate, lat = run.rate, sorted(run.latencies)
    p50 = lat[len(lat) // 2] * 1000 if lat else float("nan")
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000 if lat else float("nan")
    print(f"durable broker: {rate:,.0f} traj/s (fsync={args.fsync}), ACK p50 {p50:.1f} ms, p99 {p99:.1f} ms "
          f"(CPU s per 10k: {run.cpu_line(n)}); the producers were done after {run.producers_done_s:.3f} s, "
          f"the consumer after {run.consumer_done_s:.3f} s; {rate * len(payload) / 1e6:,.1f} MB/s of payloads, "
          f"{rate / disk_bound:.2f} of the disk ({disk:,.1f} MB/s), which bounds a durable broker at "
          f"{disk_bound:,.0f} traj/s ({disk_bound / raw1:.2f} of one-per-message ZeroMQ)", flush=True)
    one_pass, general = decode_us(args.per_put, 1 if args.smoke else 7)
    print(f"PUT header of {args.per_put} trajectories, decoded and validated: {one_pass:.1f} us in one pass, "
          f"{general:.1f} us by the general path ({one_pass / general:.2f} of it)", flush=True)
    cpu = {f"cpu_s_per_10k_{case}_{side}": round(v * 10_000 / n, 3)
           for case, r in (("raw1", raw1_run), ("broker", run)) for side, v in r.cpu.items()}
    print(json.dumps({"broker_traj_per_s": round(rate), "raw_zmq_traj_per_s": round(raw),
                      "ratio": round(rate / raw, 3), "raw_zmq_per_message_traj_per_s": round(raw1),
                      "ratio_to_per_message": round(ratio1, 3),
                      "ratio_to_per_message_rounds": [round(r[0], 3) for r in rounds],
                      "small_disk_mb_per_s": round(disk, 1),
                      "small_ratio_to_disk": round(rate / disk_bound, 3),
                      "small_disk_bound_ratio_to_per_message": round(disk_bound / raw1, 3), "p50_ack_ms": round(p50, 2),
                      "p99_ack_ms": round(p99, 2), "producers_done_s": round(run.producers_done_s, 3),
                      "consumer_done_s": round(run.consumer_done_s, 3),
                      "producers": args.producers, "per_put": args.per_put, "fsync": args.fsync,
                      "commit_every": args.commit_every, "trajectories": n, "put_decode_us": round(one_pass, 1),
                      "put_decode_general_us": round(general, 1), **cpu, **large}))


if __name__ == "__main__":
    main()

"""Reward throughput beside the same work without rlbus around it.

- Code: `--execs` executions of a small program with one assert, through
  rlbus's sandbox (network namespace, nobody, rlimits, Landlock, a private
  directory per run), beside a bare `subprocess.run` of the same interpreter
  per execution. Also end to end: the same tests as `code` EVALs through a
  broker to one reward worker.
- Reward model: SmolLM2-135M with a fresh scalar head (an
  AutoModelForSequenceClassification), `--pairs` (prompt, response) pairs
  scored through `RewardModel.score`, beside a bare batched forward pass of
  the same model on the same tokens.

    python benchmarks/reward.py [--execs N] [--pairs M]

Last line: one JSON object with sandbox_exec_per_s, bare_exec_per_s,
rm_scores_per_s, bare_rm_scores_per_s (and the end-to-end figure).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import REPO, at_least, broker_process  # noqa: E402

PROGRAM = "def double(x):\n    return 2 * x\n"
TEST = "assert double(21) == 42"


def bench_code(execs: int) -> tuple[float, float]:
    from rlbus.reward.sandbox import Sandbox

    sandbox = Sandbox()
    started = time.perf_counter()
    for _ in range(execs):
        assert sandbox.run_tests(PROGRAM, [TEST]).score == 1.0
    sandboxed = execs / (time.perf_counter() - started)
    started = time.perf_counter()
    for _ in range(execs):
        subprocess.run([sandbox.python, "-I", "-c", f"{PROGRAM}\n{TEST}"], check=True)
    bare = execs / (time.perf_counter() - started)
    return sandboxed, bare


def bench_code_via_worker(execs: int) -> float:
    from rlbus.common import protocol as P
    from rlbus.common.client import BrokerClient

    with tempfile.TemporaryDirectory(prefix="rlbus-bench-") as tmp:
        sets = [f"buffer.dir={tmp}", f"run.dir={tmp}", "logging.level=warning"]
        with broker_process(sets, Path(tmp)) as broker:
            worker = subprocess.Popen([sys.executable, "-m", "rlbus.cli", "reward", "--broker",
                                       broker.address, "--service", "code", "--set",
                                       "logging.level=warning"], cwd=REPO, stderr=subprocess.DEVNULL)
            try:
                client = BrokerClient(broker.address, "explorer", "bench")
                client.start(30)
                while not any(p["role"] == "reward" for p in client.request(P.STATUS).header["peers"]):
                    time.sleep(0.05)
                items = [{"task": {"tests": [TEST]}, "text": f"```python\n{PROGRAM}```"}] * 8
                started = time.perf_counter()
                for _ in range(max(1, execs // 8)):
                    reply = client.request(P.EVAL, {"service": "code", "items": items}, timeout=120)
                    assert all(r["score"] == 1.0 for r in reply.header["results"]), reply.header
                rate = max(1, execs // 8) * 8 / (time.perf_counter() - started)
                client.close()
            finally:
                worker.terminate()
                worker.wait(30)
    return rate


def bench_rm(pairs: int, batch: int) -> tuple[float, float]:
    import torch
    from transformers import AutoModelForSequenceClassification

    from rlbus.weights.models import prepare_bundled
    from rlbus.reward.rm import RewardModel

    base = prepare_bundled("smollm2-135m")
    with tempfile.TemporaryDirectory(prefix="rlbus-rm-") as tmp:
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
        model.save_pretrained(tmp)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (base / name).exists():
                (Path(tmp) / name).write_bytes((base / name).read_bytes())
        rm = RewardModel(tmp, batch_size=batch)
        prompts = [f"What is {i} + {i + 1}? Answer with just the number." for i in range(pairs)]
        responses = [f"{i} + {i + 1} = {2 * i + 1}" for i in range(pairs)]
        rm.score(prompts[:batch], responses[:batch])  # warm-up
        started = time.perf_counter()
        scores = rm.score(prompts, responses)
        through_rlbus = pairs / (time.perf_counter() - started)
        texts = [rm._text(p, r) for p, r in zip(prompts, responses)]
        started = time.perf_counter()
        bare_scores = []
        with torch.no_grad():
            for i in range(0, pairs, batch):
                enc = rm.tokenizer(texts[i:i + batch], return_tensors="pt", padding=True)
                bare_scores.extend(rm.model(**enc).logits[:, 0].tolist())
        bare = pairs / (time.perf_counter() - started)
        assert max(abs(a - b) for a, b in zip(scores, bare_scores)) < 1e-3
    return through_rlbus, bare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--execs", type=at_least(1), default=60)
    ap.add_argument("--pairs", type=at_least(1), default=128)
    ap.add_argument("--batch", type=at_least(1), default=16)
    ap.add_argument("--smoke", action="store_true", help="a few of each: checks that the benchmark runs")
    args = ap.parse_args()
    if args.smoke:
        args.execs, args.pairs, args.batch = 2, 4, 2
    sandboxed, bare = bench_code(args.execs)
    print(f"code: sandboxed {sandboxed:.1f} exec/s, bare subprocess {bare:.1f} exec/s ({sandboxed / bare:.2f}x)")
    via_worker = bench_code_via_worker(args.execs)
    print(f"code through the broker to one reward worker: {via_worker:.1f} exec/s")
    rm_rate, rm_bare = bench_rm(args.pairs, args.batch)
    print(f"reward model: {rm_rate:.1f} scores/s, bare batched forward {rm_bare:.1f} scores/s "
          f"({rm_rate / rm_bare:.2f}x)")
    print(json.dumps({"sandbox_exec_per_s": round(sandboxed, 1), "bare_exec_per_s": round(bare, 1),
                      "worker_exec_per_s": round(via_worker, 1), "rm_scores_per_s": round(rm_rate, 1),
                      "bare_rm_scores_per_s": round(rm_bare, 1), "execs": args.execs, "pairs": args.pairs}))


if __name__ == "__main__":
    main()

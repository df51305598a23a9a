"""What a finished run leaves behind, on one fully asynchronous run with two explorers on the tiny model:
`rlbus replay` trains again from the broker's record of what it delivered and ends at the same weights byte
for byte (and a replay that trains otherwise is told apart); `rlbus trace` is valid Chrome-trace JSON whose
spans are the logs'."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlbus.common.config import load_config
from rlbus.logview import events
from rlbus.report import FIGURES
from tests.conftest import REPO, TINY_KV_MB, free_port

pytestmark = pytest.mark.slow  # one run of the tiny model, which most of these tests read

STEPS = 6  # fewer, and the second explorer may start too late to contribute a batch
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# headless, and no background connections: the test machine has no network beyond loopback
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlbus.cli", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


def _scrape(port: int) -> dict[str, list]:
    """Samples by metric family name, as Prometheus's own parser reads them."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _value(samples: list, name: str, **labels) -> float:
    return next(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _explored(m: dict) -> bool:
    return (_value(m["rlbus_explorer_samples"], "rlbus_explorer_samples_total") > 0
            and _value(m["rlbus_explorer_weights_load_seconds"], "rlbus_explorer_weights_load_seconds_count") > 0)


@pytest.fixture(scope="module")
def async_run(tiny_model, tmp_path_factory):
    """The run's directory, and each component's /metrics as scraped while it ran (after step 2)."""
    run_dir = tmp_path_factory.mktemp("async") / "run"
    # /metrics on port .. port + 3 (broker, trainer, explorers), the broker on the next two: all free together,
    # so that none of them is handed out again to another of them
    port = free_port(6)
    sets = [f"run.dir={run_dir}", f"model.path={tiny_model}", f"broker.port={port + 4}",
            f"broker.pub_port={port + 5}", "broker.heartbeat_interval_s=0.5", "rollout.repeat=4",
            "data.batch_tasks=2", f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=2",
            "trainer.keep_checkpoints=3", "trainer.micro_batch=4", "trainer.lr=1e-3", "trainer.fetch_wait_s=1",
            "rollout.max_tokens=8", "rollout.dtype=float32", f"explorer.kv_cache_mb={TINY_KV_MB}",
            "explorer.eval_every=3", "data.eval_size=4", "launch.status_interval_s=1", "logging.format=json",
            # a reward the tiny random model scores about 0.5 on: every trained group has a spread, every
            # step changes the weights
            "reward.fn=tests.helpers.first_token:score", "algorithm.skip_zero_spread=true",
            "algorithm.informative_wait_s=2", f"metrics.prometheus_port={port}",
            # A task a lease: the tiny model rolls a batch out faster than a step trains, so whichever explorer
            # loaded the new version first took a whole batch (2 tasks) a lease, and, one a little slower every
            # time, could go through the run with none (2 runs of 32); each now takes a task of it.
            "explorer.tasks_per_lease=1"]
    args = [sys.executable, "-m", "rlbus.cli", "up", "configs/modes/multi_explorer_async.yaml"]
    err = run_dir.parent / "up.err"
    with open(err, "wb") as f:
        up = subprocess.Popen(args + [x for s in sets for x in ("--set", s)], cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=f, start_new_session=True)
    # Each component is scraped until it has shown what the test checks (the trainer: step 2; an explorer: a
    # rollout and a weight load; the broker: a delivery), while the run goes on.
    ready = {"broker": lambda m: _value(m["rlbus_broker_delivered_batches"], "rlbus_broker_delivered_batches_total"),
             "trainer": lambda m: (_value(m["rlbus_trainer_step"], "rlbus_trainer_step") >= 2 and _value(
                 m["rlbus_trainer_weights_publish_seconds"], "rlbus_trainer_weights_publish_seconds_count")),
             "explorer-0": _explored, "explorer-1": _explored}
    scraped: dict[str, dict] = {}
    try:
        deadline = time.monotonic() + 300
        while len(scraped) < len(ready) and up.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            for i, (name, done) in enumerate(ready.items()):
                try:
                    if name not in scraped and done(metrics := _scrape(port + i)):
                        scraped[name] = metrics
                except (OSError, http.client.HTTPException, KeyError, StopIteration):  # not serving or there yet
                    continue
        assert up.wait(300) == 0, err.read_text()[-3000:]
    finally:
        if up.poll() is None:  # `rlbus up` stops the children it started on SIGTERM
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()
    steps = events(run_dir / "logs" / "trainer.jsonl", "train_step")
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert all(s["grad_norm"] > 0 for s in steps), "every step changed the weights"
    return run_dir, scraped


def test_multi_explorer_async_both_explorers_feed_the_buffer(async_run):
    """The preset's ordering (with tests/test_modes.py's other modes): both explorers feed the buffer, neither
    ever waits for weights, and no step trains on data older than max_staleness."""
    run_dir, _ = async_run
    for name in ("explorer-0", "explorer-1"):
        assert events(run_dir / "logs" / f"{name}.jsonl", "explorer_batch"), f"{name} contributed"
        assert not events(run_dir / "logs" / f"{name}.jsonl", "waiting_for_weights")
    bound = load_config(REPO / "configs/modes/multi_explorer_async.yaml", [], environ={}).sync.max_staleness
    steps = events(run_dir / "logs" / "trainer.jsonl", "train_step")
    assert len(steps) == STEPS and max(int(k) for s in steps for k in s["staleness"]) <= bound


def test_an_async_run_with_two_explorers_replays_to_the_same_weights_byte_for_byte(async_run, tmp_path):
    async_run, _ = async_run
    record = json.loads((async_run / "trainer.json").read_text())
    assert record["deterministic"] and record["threads"] >= 1

    same = _cli("replay", async_run, "--out", tmp_path / "replay")
    assert same.returncode == 0, same.stdout + same.stderr[-3000:]
    # the three newest published versions (the run keeps three) and the checkpoints of steps 1, 3 and 5
    lines = same.stdout.splitlines()
    assert [x for x in lines if x.startswith("weights")] == [f"weights v{v}: equal" for v in (4, 5, 6)]
    assert [x for x in lines if x.startswith("checkpoint")] == [f"checkpoint step {s}: equal" for s in (1, 3, 5)]
    assert (tmp_path / "replay" / "weights" / f"v{STEPS}" / "model.safetensors").read_bytes() == \
        (async_run / "weights" / f"v{STEPS}" / "model.safetensors").read_bytes()

    # The comparison can fail: a replay at another learning rate is not the run.
    changed = tmp_path / "changed"
    changed.mkdir()
    for name in ("weights", "checkpoints", "buffer"):
        (changed / name).symlink_to(async_run / name)
    record["config"]["trainer"]["lr"] = 2e-3
    (changed / "trainer.json").write_text(json.dumps(record))
    other = _cli("replay", changed, "--buffer", async_run / "buffer", "--out", tmp_path / "other", "--steps", 2)
    assert other.returncode == 1, other.stdout + other.stderr[-3000:]
    assert "checkpoint step 1: DIFFERENT" in other.stdout
    assert "NOT equal" in other.stdout


def test_a_run_without_a_record_is_a_clear_error(tmp_path):
    done = _cli("replay", tmp_path)
    assert done.returncode == 2 and "trainer.json is missing" in done.stderr


@pytest.mark.parametrize("record, said", [
    ("{garbage", " is not the JSON the trainer writes (Expecting property name enclosed in double quotes: line 1 "
                 "column 2 (char 1)): it was damaged"),
    ("[]", " lacks model_path, config, threads (or holds another type): it is no record the trainer wrote, or was "
           "damaged"),
    ('{"model_path": "m", "config": 5, "threads": 1}', " lacks config (or holds another type)"),
    ('{"model_path": "m", "config": {"trainer": {"lr": "x"}}, "threads": 1}',
     ": its config does not load here: 1 validation error for RunConfig; trainer.lr; Input should be a valid number"),
])
def test_a_record_that_is_damaged_is_a_clear_error(tmp_path, record, said):
    """Each was a traceback (JSONDecodeError, TypeError, KeyError, ValidationError)."""
    (tmp_path / "trainer.json").write_text(record)
    done = _cli("replay", tmp_path)
    assert done.returncode == 2 and done.stderr.startswith(f"error: {tmp_path / 'trainer.json'}{said}"), done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_a_buffer_whose_catalogue_is_no_database_is_a_clear_error(async_run, tmp_path):
    """It was a DatabaseError traceback, after the trainer was built."""
    (tmp_path / "buffer").mkdir()
    (tmp_path / "buffer" / "buffer.sqlite3").write_bytes(bytes(range(256)) * 32)
    done = _cli("replay", async_run[0], "--buffer", tmp_path / "buffer", "--out", tmp_path / "replay")
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == (
        f"error: {tmp_path / 'buffer'}: its catalogue cannot be read (file is not a database); give the run's buffer "
        "directory (--buffer)"), done.stderr[-3000:]


def test_the_trace_is_chrome_trace_json_whose_spans_are_the_logs(async_run, tmp_path):
    async_run, _ = async_run
    out = tmp_path / "trace.json"
    done = _cli("trace", async_run, "-o", out)
    assert done.returncode == 0, done.stderr[-3000:]
    trace = json.loads(out.read_text())
    evs = trace["traceEvents"]
    for e in evs:  # the fields every Chrome-trace event of its phase needs
        assert {"name", "ph", "pid", "tid"} <= e.keys() and e["ph"] in "XiCM"
        if e["ph"] != "M":
            assert isinstance(e["ts"], int) and e["ts"] >= 0
        if e["ph"] == "X":
            assert isinstance(e["dur"], int) and e["dur"] >= 0
    names = {e["pid"]: e["args"]["name"] for e in evs if e["name"] == "process_name"}
    assert set(names.values()) >= {"broker", "trainer"} and len(names) == 4, names
    by_process = lambda process, name: [e for e in evs if names.get(e["pid"]) == process and e["name"] == name]
    for log in ("explorer-0", "explorer-1"):
        batches = events(async_run / "logs" / f"{log}.jsonl", "explorer_batch")
        peer = batches[0]["peer"]
        rollouts = by_process(peer, "rollout")
        assert [r["dur"] for r in rollouts] == [round(b["rollout_s"] * 1e6) for b in batches]
        puts = by_process(peer, "put")
        assert len(puts) == len(events(async_run / "logs" / f"{log}.jsonl", "put_acked")) >= 1
        loads = [e for e in evs if names.get(e["pid"]) == peer and e["name"].startswith("load v")]
        assert len(loads) == len(events(async_run / "logs" / f"{log}.jsonl", "weights_loaded"))
    steps = events(async_run / "logs" / "trainer.jsonl", "train_step")
    spans = [e for e in evs if names.get(e["pid"]) == "trainer" and e["name"].startswith("step ")]
    assert [s["name"] for s in spans] == [f"step {s['step']}" for s in steps]
    assert [s["dur"] for s in spans] == [round(s["step_s"] * 1e6) for s in steps]
    publishes = [e for e in evs if names.get(e["pid"]) == "trainer" and e["name"].startswith("publish v")]
    assert [p["dur"] for p in publishes] == \
        [round(e["seconds"] * 1e6) for e in events(async_run / "logs" / "trainer.jsonl", "weights_published")]
    delivered = [e for e in evs if names.get(e["pid"]) == "broker" and e["name"] == "batch_delivered"]
    assert len(delivered) == STEPS
    assert any(e["ph"] == "C" and e["name"] == "buffer depth" for e in evs)


def test_every_component_served_its_metrics_while_the_run_went_on(async_run):
    _, scraped = async_run
    assert set(scraped) == {"broker", "trainer", "explorer-0", "explorer-1"}, "each scraped while it ran"
    broker, trainer = scraped["broker"], scraped["trainer"]
    assert _value(broker["rlbus_broker_trajectories"], "rlbus_broker_trajectories_total", state="stored") > 0
    assert _value(broker["rlbus_broker_delivered_trajectories"], "rlbus_broker_delivered_trajectories_total") > 0
    assert _value(broker["rlbus_broker_put_ack_seconds"], "rlbus_broker_put_ack_seconds_count") > 0
    assert _value(broker["rlbus_broker_staleness"], "rlbus_broker_staleness_count") > 0
    assert _value(broker["rlbus_broker_peers"], "rlbus_broker_peers", role="explorer") == 2
    assert "rlbus_broker_buffer_depth" in broker and "rlbus_broker_policy_version" in broker
    assert _value(trainer["rlbus_trainer_step"], "rlbus_trainer_step") >= 2
    assert _value(trainer["rlbus_trainer_staleness"], "rlbus_trainer_staleness_count") > 0
    assert _value(trainer["rlbus_trainer_samples"], "rlbus_trainer_samples_total") > 0
    assert {"rlbus_trainer_loss", "rlbus_trainer_reward_mean", "rlbus_trainer_tokens_per_second"} <= trainer.keys()
    assert 0 <= _value(trainer["rlbus_trainer_core_wait"], "rlbus_trainer_core_wait") <= 1
    for name in ("explorer-0", "explorer-1"):
        explorer = scraped[name]
        assert _value(explorer["rlbus_explorer_samples"], "rlbus_explorer_samples_total") > 0
        assert _value(explorer["rlbus_explorer_rollout_seconds"], "rlbus_explorer_rollout_seconds_count") > 0
        assert 0 <= _value(explorer["rlbus_explorer_core_wait"], "rlbus_explorer_core_wait") <= 1
        assert _value(explorer["rlbus_explorer_weights_load_seconds"],
                      "rlbus_explorer_weights_load_seconds_count") > 0


def test_tensorboard_holds_the_trainers_step_scalars_and_the_evaluations(async_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = async_run
    trainer = EventAccumulator(str(run_dir / "tensorboard" / "trainer")).Reload()
    steps = events(run_dir / "logs" / "trainer.jsonl", "train_step")
    for tag, key in (("train_step/loss", "loss"), ("train_step/reward_mean", "reward_mean")):
        logged = [(s["step"], s[key]) for s in steps if s.get(key) is not None]
        assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in trainer.Scalars(tag)] == logged
    evaluator = EventAccumulator(str(run_dir / "tensorboard" / "explorer-0")).Reload()
    evals = events(run_dir / "logs" / "explorer-0.jsonl", "eval")
    assert evals and [(e.step, e.value) for e in evaluator.Scalars("eval/accuracy")] == \
        [(e["policy_version"], pytest.approx(e["accuracy"], rel=1e-6)) for e in evals]


class _Figures(HTMLParser):
    """The report's figures (id -> the plot element in it) and any link that is not inline data."""

    def __init__(self, text: str):
        super().__init__()
        self.open, self.plots, self.links = None, {}, []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "figure":
            self.open = attrs.get("id")
        elif tag in ("svg", "img") and self.open:
            self.plots.setdefault(self.open, tag)
        self.links += [v for k, v in attrs.items() if k in ("href", "src") and not v.startswith("data:")]


@pytest.fixture(scope="module")
def report_page(async_run, tmp_path_factory) -> Path:
    page = tmp_path_factory.mktemp("report") / "report.html"
    done = _cli("report", async_run[0], "-o", page)
    assert done.returncode == 0, done.stderr[-3000:]
    return page


def test_the_report_is_one_self_contained_page_with_every_plot(report_page):
    parsed = _Figures(report_page.read_text())
    assert set(parsed.plots) == set(FIGURES) and not parsed.links, parsed.links
    assert parsed.plots["timeline"] == "img" and parsed.plots["reward"] == "svg"
    assert f"trainer steps</th><td>{STEPS}<" in report_page.read_text()


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here to render the page in (Debian: apt install chromium)")
def test_the_report_renders_in_headless_chromium_with_every_plot(report_page, tmp_path):
    dom = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path}", "--dump-dom",
                          report_page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert set(_Figures(dom.stdout).plots) == set(FIGURES)

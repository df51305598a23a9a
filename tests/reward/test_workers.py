"""Reward workers behind the broker: load sharing, a worker dying mid-request, unknown services."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from rlbus.common import protocol as P
from rlbus.common.client import BrokerError
from rlbus.reward.base import Response
from rlbus.reward.worker import RemoteReward
from tests.conftest import REPO, free_port, recv
from tests.helpers.waiting import wait_for

SLOW = "tests.helpers.slow_reward:score"


@pytest.fixture
def workers(tmp_path):
    started = []

    def start(b, name, *sets):
        args = [sys.executable, "-m", "rlbus.cli", "reward", "--broker", b.address, "--name", name,
                "--service", "math", "--service", SLOW, "--set", "broker.heartbeat_interval_s=0.2",
                "--set", "logging.format=json", *[x for s in sets for x in ("--set", s)]]
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{name}.log", "w"))
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


def wait_for_services(tool, n, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        peers = [p for p in tool.request(P.STATUS).header["peers"] if p["role"] == "reward"]
        if len(peers) >= n:
            return
        time.sleep(0.1)
    raise TimeoutError("reward workers did not register")


def test_workers_share_the_load_and_answer_in_order(broker_factory, clients, workers):
    b = broker_factory("reward.eval_timeout_s=30")
    workers(b, "w1")
    workers(b, "w2")
    ex = clients(b, "explorer", "ex")
    wait_for_services(ex, 2)
    remote = RemoteReward(ex, SLOW, 30)
    tasks = [{"answer": str(i), "sleep": 0.3} for i in range(4)]
    responses = [Response(str(i) if i % 2 == 0 else "wrong") for i in range(4)]
    with ThreadPoolExecutor(6) as pool:
        batches = list(pool.map(lambda _: remote.score_batch(tasks, responses), range(6)))
    for results in batches:
        assert [r.score for r in results] == [1.0, 0.0, 1.0, 0.0]
    assert {r.details["served_by"] for results in batches for r in results} == {"w1", "w2"}
    math = RemoteReward(ex, "math", 30).score_batch([{"answer": "42"}], [Response("\\boxed{42}")])
    assert math[0].score == 1.0


def test_a_worker_dying_mid_request_has_its_request_rerouted(broker_factory, clients, workers):
    b = broker_factory("reward.eval_timeout_s=30")
    procs = {"w1": workers(b, "w1"), "w2": workers(b, "w2")}
    ex = clients(b, "explorer", "ex")
    wait_for_services(ex, 2)
    pending = ex.submit(P.EVAL, {"service": SLOW, "items": [{"task": {"answer": "x", "sleep": 2}, "text": "x"}]})
    deadline = time.monotonic() + 10
    routed = []
    while not routed and time.monotonic() < deadline:
        routed = [e for e in b.log_events() if e["event"] == "eval_routed"]
        time.sleep(0.02)
    victim = routed[0]["worker"]
    os.kill(procs[victim].pid, signal.SIGKILL)
    reply = pending.result(20)
    assert reply.command == P.RESULT and reply.header["results"][0]["score"] == 1.0
    assert reply.header["served_by"] != victim
    assert any(e["event"] == "eval_rerouted" and e["lost_worker"] == victim for e in b.log_events())


def test_items_a_reward_cannot_score_get_the_failure_score_and_the_worker_serves_on(broker_factory, clients, workers):
    """An item without a task and a plugin whose answer is no number (a string, nil, a list): each such item is
    scored `failure_score` with its reason, the rest of the job as usual, and the worker stays up for the next."""
    b = broker_factory("reward.eval_timeout_s=30")
    proc = workers(b, "w1", "reward.failure_score=-1.0")
    ex = clients(b, "explorer", "ex")
    wait_for_services(ex, 1)
    items = [{"text": "x"}, *({"task": {"give": given}, "text": "x"} for given in ("abc", None, [1, 2])),
             {"task": {"answer": "x"}, "text": "x"}]
    reply = ex.submit(P.EVAL, {"service": SLOW, "items": items}).result(30)
    assert reply.command == P.RESULT, reply.header
    results = reply.header["results"]
    assert [r["score"] for r in results] == [-1.0, -1.0, -1.0, -1.0, 1.0]
    assert [r["reason"] for r in results[:4]] == ["reward raised an exception"] + ["reward was not a finite number"] * 3
    assert proc.poll() is None
    assert RemoteReward(ex, "math", 30).score_batch([{"answer": "42"}], [Response("\\boxed{42}")])[0].score == 1.0


def test_a_service_that_fails_on_a_job_answers_it_with_the_failure_score_and_serves_the_next(broker_factory, clients,
                                                                                              tmp_path):
    """A service whose scoring raises (a reward model on input it cannot take, say): the job is answered, each
    item with `failure_score` and the reason, and the worker goes on. In process, the failing service a stand-in."""
    import threading

    from rlbus.common.config import load_config
    from rlbus.reward.worker import RewardWorker

    b = broker_factory("reward.eval_timeout_s=30")
    cfg = load_config(None, [f"broker.address={b.address}", "broker.heartbeat_interval_s=0.2",
                             "reward.failure_score=-1.0", f"run.dir={tmp_path}"], environ={})
    worker = RewardWorker(cfg, [SLOW], "w-in-process")  # not math: math-verify times out by signal, main thread only

    def fails(items):
        raise RuntimeError("cannot take this input")

    worker.handlers["fails"] = fails
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        ex = clients(b, "explorer", "ex")
        wait_for_services(ex, 1)
        reply = ex.submit(P.EVAL, {"service": "fails", "items": [{"text": "a"}, {"text": "b"}]}).result(30)
        assert [(r["score"], r["reason"]) for r in reply.header["results"]] == \
            [(-1.0, "the reward service failed on this job")] * 2
        assert "cannot take this input" in reply.header["results"][0]["details"]["error"]
        assert [r.score for r in RemoteReward(ex, SLOW, 30).score_batch([{"answer": "x"}] * 2,
                                                                        [Response("x"), Response("y")])] == [1.0, 0.0]
    finally:
        worker.stop()
        thread.join(10)
    assert not thread.is_alive()


def hand_made_workers(b, raw_dealer, *names: str) -> dict[str, zmq.Socket]:
    """Reward workers as bare sockets, to answer what no rlbus worker would."""
    socks = {}
    for name in names:
        sock = socks[name] = raw_dealer(b.address)
        sock.send_multipart(P.encode(P.HELLO, {"role": "reward", "name": name, "req": 1,
                                               "capabilities": {"services": ["math"]}}))
        assert recv(sock).command == P.WELCOME
    return socks


def next_job(socks: dict[str, zmq.Socket], timeout_s: float = 10) -> tuple[str, P.Message]:
    """(worker, EVAL) of the next job any of `socks` is given."""
    poller = zmq.Poller()
    for sock in socks.values():
        poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for sock, _ in poller.poll(100):
            name = next(n for n, s in socks.items() if s is sock)
            msg = P.decode_reply(sock.recv_multipart())
            if msg.command == P.EVAL:
                return name, msg
    raise TimeoutError("no worker was given the job")


@pytest.mark.parametrize("results, named", [
    ([{"score": float("nan")}, {"score": 1.0}], "a finite `float` - at `$.results[0].score`"),
    ([{"score": 1.0, "details": {}, "reason": ""}], "1 results for 2 items"),
    (["1.0", "0.0"], "at `$.results[0]`"),
])
def test_a_worker_answering_with_other_than_a_finite_score_per_item_is_told_so_and_its_job_goes_to_another(
        broker_factory, clients, raw_dealer, results, named):
    """A RESULT with a NaN score reached the asker (whose PUT of that reward was then refused: rewards are finite),
    and one of another length failed the job outright: now the broker refuses such an answer, naming what is wrong,
    and gives the job to another worker at once (not after reward.eval_timeout_s)."""
    b = broker_factory("reward.eval_timeout_s=60")
    socks = hand_made_workers(b, raw_dealer, "w1", "w2")
    asker = clients(b, "explorer", "ex")
    pending = asker.submit(P.EVAL, {"service": "math", "items": [{"text": "1"}, {"text": "2"}]})
    first, job = next_job(socks)
    socks[first].send_multipart(P.encode(P.RESULT, {"job": job.header["job"], "results": results}))
    refused = recv(socks[first])
    assert refused.command == P.ERROR and refused.header["code"] == "bad_field", refused.header
    assert named in refused.header["message"], refused.header["message"]
    second, again = next_job({n: s for n, s in socks.items() if n != first})
    assert again.header["job"] == job.header["job"]
    good = [{"score": 1.0, "details": {}, "reason": ""}, {"score": 0.0, "details": {}, "reason": "wrong"}]
    socks[second].send_multipart(P.encode(P.RESULT, {"job": job.header["job"], "results": good}))
    reply = pending.result(10)
    assert reply.command == P.RESULT and reply.header["served_by"] == second
    assert [r["score"] for r in reply.header["results"]] == [1.0, 0.0]
    assert any(e["event"] == "eval_answer_refused" and e["worker"] == first for e in b.log_events())


def test_a_job_whose_every_answer_is_refused_fails_with_the_last_reason(broker_factory, clients, raw_dealer):
    b = broker_factory("reward.eval_timeout_s=60", "reward.eval_attempts=2")
    socks = hand_made_workers(b, raw_dealer, "only")
    asker = clients(b, "explorer", "ex")
    pending = asker.submit(P.EVAL, {"service": "math", "items": [{"text": "1"}]})
    for _ in range(2):  # the only worker gets it again: every attempt is its
        _, job = next_job(socks)
        socks["only"].send_multipart(P.encode(P.RESULT, {"job": job.header["job"], "results": [{"score": "high"}]}))
        assert recv(socks["only"]).header["code"] == "bad_field"
    with pytest.raises(BrokerError, match=r"eval_failed.*2 attempts \(the last: worker only: RESULT: Expected `float`"):
        pending.result(10)


def test_an_explorers_remote_reward_waits_for_a_worker_to_offer_its_service_and_gives_up_only_when_stopping(
        broker_factory, clients, workers):
    """An explorer asking for a service no worker offers (none started yet, or every one restarting) stopped with
    the broker's no_service; now its reward asks again after a backoff until a worker comes, or it is stopping."""
    b = broker_factory("reward.eval_timeout_s=30")
    ex = clients(b, "explorer", "ex")
    refusals = lambda: sum(1 for e in b.log_events()  # noqa: E731
                           if e["event"] == "eval_failed" and e["code"] == "no_service")
    remote = RemoteReward(ex, "math", 30, backoff_max_s=0.5)
    with ThreadPoolExecutor(1) as pool:
        scored = pool.submit(remote.score_batch, [{"answer": "42"}], [Response("\\boxed{42}")])
        wait_for(lambda: refusals() >= 2, 30, "the EVAL refused twice")
        assert not scored.done()
        workers(b, "late")
        assert [r.score for r in scored.result(30)] == [1.0]
        assert scored.result()[0].details["served_by"] == "late"
        seen = refusals()
        unserved = pool.submit(RemoteReward(ex, "nobody-offers-this", 30, backoff_max_s=0.5).score_batch,
                               [{"answer": "1"}], [Response("1")])
        wait_for(lambda: refusals() > seen, 30, "the EVAL of a service nobody offers refused")
        assert not unserved.done()
        ex.stopping()
        with pytest.raises(BrokerError, match="no_service"):
            unserved.result(10)


def test_a_service_no_worker_offers_is_a_clear_error(broker, clients):
    ex = clients(broker, "explorer", "ex")
    with pytest.raises(BrokerError, match="no_service.*'code'.*rlbus reward"):
        ex.request(P.EVAL, {"service": "code", "items": [{"task": {}, "text": ""}]})


def test_a_worker_serves_its_counts_on_metrics(broker_factory, clients, workers):
    b = broker_factory("reward.eval_timeout_s=30")
    port = free_port()
    workers(b, "w1", f"metrics.prometheus_port={port}")
    ex = clients(b, "explorer", "ex")
    wait_for_services(ex, 1)
    RemoteReward(ex, "math", 30).score_batch([{"answer": "42"}] * 3, [Response("\\boxed{42}")] * 3)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["rlbus_reward_scored_total"] == 3 and samples["rlbus_reward_jobs_total"] == 1
    assert samples["rlbus_reward_scoring_seconds_total"] > 0


def test_a_worker_the_broker_refuses_exits_with_its_reason_in_one_line(broker, workers, tmp_path):
    """A HELLO refused for good (a name over 128 characters): the broker's reason, exit 1, no traceback."""
    name = "x" * 129
    proc = workers(broker, name)
    assert proc.wait(60) == 1
    stderr = (tmp_path / f"{name}.log").read_text()
    assert stderr.splitlines()[-1] == "error: bad_field: HELLO: Expected `str` of length <= 128 - at `$.name`", \
        stderr[-2000:]
    assert "Traceback" not in stderr


def test_a_worker_told_to_stop_while_no_broker_answers_stops_at_once(tmp_path):
    """^C while the broker is not there yet: exit 0 with a line that says so, not a wait for the start timeout
    (60 s) and a traceback."""
    log = tmp_path / "worker.log"
    args = [sys.executable, "-m", "rlbus.cli", "reward", "--broker", f"tcp://127.0.0.1:{free_port()}",
            "--set", "broker.heartbeat_interval_s=0.1", "--set", "broker.liveness=2", "--set", "logging.format=json"]
    with open(log, "w") as err:
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for(lambda: "broker_unreachable" in log.read_text(), 60, "the worker waiting for its broker")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
    stderr = log.read_text()
    assert stderr.splitlines()[-1].startswith("stopped before the broker at tcp://127.0.0.1:"), stderr[-2000:]
    assert "Traceback" not in stderr


def test_a_reward_model_worker_without_a_model_it_can_load_says_so_in_one_line(tmp_path):
    """Both were a traceback (a ValueError; the model hub's error for a path that is not there). The worker's log
    file says it too (`reward_failed`: what `rlbus up` reports for it), stderr once."""
    from rlbus.logview import events

    for sets, said in (([], "error: service rm needs reward.rm_path"),
                       ([f"reward.rm_path={tmp_path / 'nope'}"], f"error: reward.rm_path='{tmp_path / 'nope'}': no "
                                                                  "sequence-classification model loads from it")):
        log = tmp_path / f"reward-{len(sets)}.jsonl"
        sets = [*sets, "logging.format=json", f"logging.file={log}"]
        done = subprocess.run([sys.executable, "-m", "rlbus.cli", "reward", "--broker", "tcp://127.0.0.1:1",
                               "--service", "rm", *[a for s in sets for a in ("--set", s)]],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stderr.startswith(said), done.stderr[-2000:]
        assert len(done.stderr.splitlines()) == 1, done.stderr[-2000:]
        failed = [e["error"] for e in events(log, "reward_failed")]
        assert len(failed) == 1 and done.stderr == f"error: {failed[0]}\n"

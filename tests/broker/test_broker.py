"""Broker behaviour over real sockets against a real broker process."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from rlbus.common import protocol as P
from rlbus.common.client import BrokerError
from tests.conftest import group, recv
from tests.helpers.waiting import wait_for


def status(c) -> dict:
    return c.request(P.STATUS).header


def test_join_status_and_leave(broker, clients):
    """HELLO registers a peer, STATUS lists it, BYE removes it at once."""
    a = clients(broker, "explorer", "ex-a")
    t = clients(broker, "tool", "tool-1")
    first = status(t)
    names = {p["name"] for p in first["peers"]}
    assert {"ex-a", "tool-1"} <= names
    assert 0 < first["uptime_s"] <= status(t)["uptime_s"]  # seconds since the broker started (to the ms)
    assert a.welcome["weights"]["version"] == 0
    a.close(bye=True)
    wait_for(lambda: "ex-a" not in {p["name"] for p in status(t)["peers"]}, 3, "ex-a dropped")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from /proc")
def test_the_brokers_writer_thread_carries_its_name_in_the_os(broker, clients):
    """`top -H`, `ps -L` and the throughput benchmark's CPU by thread tell the writer from the event loop."""
    clients(broker, "tool", "tool-1")  # answered: the broker is up, its writer started with its store
    tasks = Path(f"/proc/{broker.proc.pid}/task")

    def names() -> set[str]:
        return {(t / "comm").read_text().strip() for t in tasks.iterdir()}

    wait_for(lambda: "rlbus-writer" in names(), 10, "the writer named itself as it started")  # its first act


def test_silent_peer_expires_and_its_leases_return(broker, clients, raw_dealer):
    """A peer that stops heartbeating is dropped after liveness x interval; its leases are re-issued."""
    sock = raw_dealer(broker.address)
    sock.send_multipart(P.encode(P.HELLO, {"role": "explorer", "name": "mute", "req": 1}))
    assert recv(sock).command == P.WELCOME
    sock.send_multipart(P.encode(P.LEASE, {"req": 2, "max_tasks": 2, "policy_version": 0}))
    leased = recv(sock)
    assert leased.command == P.TASKS
    seqs = sorted(t["seq"] for t in leased.header["tasks"])
    tool = clients(broker, "tool", "watcher")
    wait_for(lambda: "mute" not in {p["name"] for p in status(tool)["peers"]}, 5, "mute dropped")
    other = clients(broker, "explorer", "ex-b")
    again = other.request(P.LEASE, {"max_tasks": 2, "policy_version": 0})
    assert sorted(t["seq"] for t in again.header["tasks"]) == seqs
    assert all(t["lease_id"].endswith(".1") for t in again.header["tasks"])


def test_a_peer_dropped_for_silence_gets_back_the_leases_nobody_took_when_it_returns(broker, clients, raw_dealer):
    """A peer silent beyond the liveness window (a stalled process) is dropped and its leases go back to the queue,
    but it may still be rolling them out: back with the same session, it gets again those no other explorer took
    meanwhile, so their tasks are not done twice. The one another explorer took stays that explorer's."""
    hello = {"role": "explorer", "name": "stalled", "session": "s-1"}
    sock = raw_dealer(broker.address)
    sock.send_multipart(P.encode(P.HELLO, dict(hello, req=1)))
    assert recv(sock).command == P.WELCOME
    sock.send_multipart(P.encode(P.LEASE, {"req": 2, "max_tasks": 2, "policy_version": 0}))
    granted = recv(sock).header["tasks"]
    assert [t["seq"] for t in granted] == [0, 1]
    other = clients(broker, "explorer", "other")
    wait_for(lambda: "stalled" not in {p["name"] for p in status(other)["peers"]}, 5, "stalled dropped")
    taken = other.request(P.LEASE, {"max_tasks": 1, "policy_version": 0}).header["tasks"]
    assert [(t["seq"], t["lease_id"]) for t in taken] == [(0, "t0.1")]
    sock.send_multipart(P.encode(P.HELLO, dict(hello, req=3)))
    assert recv(sock).command == P.WELCOME
    sock.send_multipart(P.encode(P.LEASE, {"req": 2, "max_tasks": 2, "policy_version": 0}))  # unanswered: resent
    assert recv(sock).header["tasks"] == granted[1:]
    sock.send_multipart(P.encode(P.LEASE, {"req": 4, "max_tasks": 1, "policy_version": 0}))
    assert [t["seq"] for t in recv(sock).header["tasks"]] == [2]
    tasks = status(other)["tasks"]
    assert (tasks["issued"], tasks["leased"]) == (3, 3)
    joined = [e for e in broker.log_events() if e["event"] == "peer_joined" and e["peer"] == "stalled"]
    assert [e["leases_restored"] for e in joined] == [0, 1]


def test_a_lease_resent_after_a_reconnect_gets_the_tasks_it_was_granted(broker, raw_dealer):
    """A peer that reconnects resends every request still unanswered, with its `req`. When the broker had already
    granted that LEASE (its TASKS went to the old connection, or crossed the resend), the resend gets the same
    tasks: a second grant would leave the first leased to a peer that never saw it, for `lease_timeout_s`."""
    hello = {"role": "explorer", "name": "mover", "session": "s-1"}
    first = raw_dealer(broker.address)
    first.send_multipart(P.encode(P.HELLO, dict(hello, req=1)))
    assert recv(first).command == P.WELCOME
    first.send_multipart(P.encode(P.LEASE, {"req": 2, "max_tasks": 2, "policy_version": 0}))
    granted = recv(first)
    assert granted.command == P.TASKS
    first.close(0)  # the reply is taken as lost: the peer comes back on a new connection and resends
    second = raw_dealer(broker.address)
    second.send_multipart(P.encode(P.HELLO, dict(hello, req=3)))
    assert recv(second).command == P.WELCOME
    second.send_multipart(P.encode(P.LEASE, {"req": 2, "max_tasks": 2, "policy_version": 0}))
    again = recv(second)
    assert again.command == P.TASKS and again.header["req"] == 2
    assert again.header["tasks"] == granted.header["tasks"]
    second.send_multipart(P.encode(P.LEASE, {"req": 4, "max_tasks": 1, "policy_version": 0}))
    more = recv(second)  # a new request is a new grant
    assert more.command == P.TASKS
    assert {t["seq"] for t in more.header["tasks"]}.isdisjoint(t["seq"] for t in granted.header["tasks"])
    second.send_multipart(P.encode(P.LEASE, {"req": 4, "max_tasks": 1, "policy_version": 0}))
    same_req = recv(second)  # a req used again on the connection that was granted it: another request, not a resend
    assert same_req.command == P.TASKS and same_req.header["tasks"] != more.header["tasks"]


def test_leases_outlive_a_broker_restart_with_their_request_and_their_holders_session(broker_factory, raw_dealer):
    """A lease keeps, in the catalogue, the request that granted it and its holder's HELLO session. After a broker
    restart (SIGKILL): the holder, back with its session, gets the same tasks for its resent LEASE; a new process
    under the name of one that is gone inherits none of what that one held (released as it says HELLO, so a LEASE
    of it with the same req is a new grant); and a holder that never comes back has its leases released once the
    broker has waited two liveness windows for it, not `lease_timeout_s` (600 s) later."""
    b = broker_factory("data.batch_tasks=4")

    def hello(name: str, session: str):
        sock = raw_dealer(b.address)
        sock.send_multipart(P.encode(P.HELLO, {"role": "explorer", "name": name, "session": session, "req": 1}))
        assert recv(sock).command == P.WELCOME
        return sock

    def lease(sock, req: int, max_tasks: int = 1) -> P.Message:
        sock.send_multipart(P.encode(P.LEASE, {"req": req, "max_tasks": max_tasks, "policy_version": 0}))
        return recv(sock)

    kept, taken, gone = (lease(hello(name, f"s-{name}"), 2).header["tasks"] for name in ("kept", "taken", "gone"))
    b.kill()
    b.start()
    back = hello("kept", "s-kept")
    assert lease(back, 2).header["tasks"] == kept
    # Released as the new process says HELLO, the old one's task is the first to issue again: a new lease of it.
    newcomer = hello("taken", "another process")
    again = lease(newcomer, 2).header["tasks"]
    assert [t["seq"] for t in again] == [taken[0]["seq"]] and again[0]["lease_id"] != taken[0]["lease_id"]
    fresh = hello("fresh", "s-fresh")
    assert [t["seq"] for t in lease(fresh, 2, 4).header["tasks"]] == [3]  # the batch's last task: 2 is still out
    deadline, got = time.monotonic() + 20, []
    while not got and time.monotonic() < deadline:
        reply = lease(fresh, 3 + len(got), 4)
        if reply.command == P.TASKS:
            got = reply.header["tasks"]
        else:
            assert reply.command == P.WAIT  # the next batch waits for version 1 meanwhile
            for sock in (back, newcomer):  # alive: their leases stay theirs
                sock.send_multipart(P.encode(P.HEARTBEAT, {}))
            time.sleep(0.1)
    assert [t["seq"] for t in got] == [gone[0]["seq"]]
    assert any(e["event"] == "leases_released" for e in b.log_events())


def test_a_stalled_broker_keeps_the_peers_that_went_on_talking_and_drops_the_silent(broker, clients, raw_dealer):
    """The broker's own stall (here SIGSTOP; on a loaded host, a starved process) is not its peers' silence: a
    peer whose heartbeats waited in the socket meanwhile is kept, and one that went quiet still expires."""
    talker = clients(broker, "explorer", "talker")
    mute = raw_dealer(broker.address)
    mute.send_multipart(P.encode(P.HELLO, {"role": "explorer", "name": "mute", "req": 1}))
    assert recv(mute).command == P.WELCOME
    os.kill(broker.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(3)  # three liveness windows (heartbeats every 0.2 s, liveness 5)
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)
    tool = clients(broker, "tool", "watcher")
    wait_for(lambda: "mute" not in {p["name"] for p in status(tool)["peers"]}, 5, "mute dropped")
    events = broker.log_events()
    assert any(e["event"] == "broker_stalled" and e["seconds"] >= 2.5 for e in events)
    left = [e for e in events if e["event"] == "peer_left"]
    assert [e["peer"] for e in left] == ["mute"] and left[0]["reason"] == "expired"
    assert talker.request(P.LEASE, {"max_tasks": 1, "policy_version": 0}).command == P.TASKS


@pytest.mark.parametrize("late_first", [False, True])
def test_a_group_for_a_lapsed_lease_is_still_stored_and_so_is_the_reissued_one(broker_factory, clients, late_first):
    """A lease not completed within lease_timeout goes to the next explorer under a new lease id. The lapsed
    lease's group, PUT late, is still kept (its samples are valid for their version), and so is the group of the
    lease issued in its place, in either order: the task is done once, and the trainer gets both groups."""
    b = broker_factory("broker.lease_timeout_s=0.5", "data.batch_tasks=1")
    slow = clients(b, "explorer", "slow")
    first = slow.request(P.LEASE, {"max_tasks": 1, "policy_version": 0}).header["tasks"][0]
    time.sleep(1.0)
    fast = clients(b, "explorer", "fast")
    again = fast.request(P.LEASE, {"max_tasks": 1, "policy_version": 0}).header["tasks"][0]
    assert again["seq"] == first["seq"] and again["lease_id"] != first["lease_id"]
    puts = [(fast, again["lease_id"]), (slow, first["lease_id"])]
    for client, lease in reversed(puts) if late_first else puts:
        assert len(client.put(group(lease, size=2), timeout=5)["stored"]) == 2
    tasks = status(slow)["tasks"]
    assert (tasks["issued"], tasks["leased"], tasks["done"]) == (1, 0, 1)
    trainer = clients(b, "trainer", "tr")
    batch = trainer.request(P.FETCH, {"step": 0, "max_groups": 4, "min_groups": 2})
    assert sorted(g["group_id"] for g in batch.header["groups"]) == sorted([again["lease_id"], first["lease_id"]])


def test_duplicate_puts_are_stored_once(broker, clients):
    """Resending the same trajectory ids is ACKed as duplicate and stored once."""
    c = clients(broker, "explorer", "dup")
    items = group("g1", size=3)
    first = c.put(items, timeout=5)
    second = c.put(items, timeout=5)
    assert sorted(first["stored"]) == ["g1.0", "g1.1", "g1.2"]
    assert second["stored"] == [] and sorted(second["duplicate"]) == ["g1.0", "g1.1", "g1.2"]
    assert status(c)["buffer"]["stored"] == 3


def test_fetch_commit_and_redelivery_after_trainer_restart(broker_factory, clients):
    """An uncommitted batch is delivered again for the same step; a committed one never."""
    broker = broker_factory("sync.max_staleness=4")
    ex = clients(broker, "explorer", "ex")
    for i in range(3):
        ex.put(group(f"g{i}", size=2), timeout=5)
    tr = clients(broker, "trainer", "tr")
    b0 = tr.request(P.FETCH, {"step": 0, "max_groups": 2, "min_groups": 2})
    assert b0.command == P.BATCH
    ids0 = [g["group_id"] for g in b0.header["groups"]]
    assert ids0 == ["g0", "g1"]
    parts = P.split_payloads([t for g in b0.header["groups"] for t in g["trajectories"]], b0.payloads)
    assert bytes(parts[0]) == b"payload-of-g0.0" and len(parts) == 4
    tr.close(bye=True)
    tr2 = clients(broker, "trainer", "tr-restarted")
    again = tr2.request(P.FETCH, {"step": 0, "max_groups": 2, "min_groups": 2})
    assert [g["group_id"] for g in again.header["groups"]] == ids0
    assert tr2.request(P.COMMIT, {"step": 0}).command == P.OK
    b1 = tr2.request(P.FETCH, {"step": 1, "max_groups": 2, "min_groups": 1})
    assert [g["group_id"] for g in b1.header["groups"]] == ["g2"]
    with pytest.raises(BrokerError, match="conflict"):
        tr2.request(P.FETCH, {"step": 0, "max_groups": 2})


def test_fetch_excludes_stale_and_zero_spread_groups(broker_factory, clients):
    """Groups older than max_staleness for the step, and all-equal-reward groups, are never delivered."""
    b = broker_factory("sync.sync_style=async", "sync.max_staleness=2")
    ex = clients(b, "explorer", "ex")
    tr = clients(b, "trainer", "tr")
    for step in range(6):  # the trainer reaches step 6 with nothing to train on
        assert tr.request(P.FETCH, {"step": step, "max_groups": 8}).command == P.EMPTY
    ex.put(group("old", version=0), timeout=5)
    ex.put(group("flat", version=5, rewards=[1.0, 1.0]), timeout=5)
    ex.put(group("fresh", version=4), timeout=5)
    batch = tr.request(P.FETCH, {"step": 6, "max_groups": 8, "skip_zero_spread": True})
    assert [g["group_id"] for g in batch.header["groups"]] == ["fresh"]
    assert batch.header["expired"] == 2 and batch.header["skipped"] == 2
    for g in batch.header["groups"]:
        assert all(6 - t["policy_version"] <= 2 for t in g["trajectories"])


def test_incomplete_group_is_not_fetched_and_held_fetch_wakes(broker, clients):
    """Only complete groups are fetched; a FETCH with wait_ms is answered when the group completes."""
    ex = clients(broker, "explorer", "ex")
    items = group("g", size=2)
    ex.put(items[:1], timeout=5)
    tr = clients(broker, "trainer", "tr")
    assert tr.request(P.FETCH, {"step": 0, "max_groups": 1}).command == P.EMPTY
    pending = tr.submit(P.FETCH, {"step": 0, "max_groups": 1, "wait_ms": 5000})
    time.sleep(0.2)
    assert not pending.done()
    ex.put(items[1:], timeout=5)
    reply = pending.result(5)
    assert reply.command == P.BATCH and reply.header["groups"][0]["group_id"] == "g"


def test_publish_reaches_bus_and_welcome(broker, clients):
    """PUBLISH puts the weight state on the bus and into every later WELCOME."""
    ex = clients(broker, "explorer", "ex")
    tr = clients(broker, "trainer", "tr")
    tr.request(P.PUBLISH, {"version": 3, "method": "checkpoint", "location": "/w/v3", "digest": "abc", "step": 3})
    wait_for(lambda: ex.weights and ex.weights["version"] == 3, 5, "version 3 on the bus")
    late = clients(broker, "explorer", "late")
    assert late.welcome["weights"]["location"] == "/w/v3"


def test_publish_of_a_version_no_explorer_could_load_is_refused(broker, clients):
    """Above version 0, an empty location needs a broadcast announcement; the state stays as it was."""
    tr = clients(broker, "trainer", "tr")
    with pytest.raises(BrokerError, match="bad_field.*version 2 has an empty location and no broadcast"):
        tr.request(P.PUBLISH, {"version": 2, "method": "nccl", "location": "", "digest": ""})
    assert tr.request(P.STATUS).header["weights"]["version"] == 0
    tr.request(P.PUBLISH, {"version": 0, "method": "checkpoint", "location": "", "digest": ""})  # the initial model
    tr.request(P.PUBLISH, {"version": 2, "method": "checkpoint", "location": "/w/v2", "digest": "abc"})
    assert tr.request(P.STATUS).header["weights"]["location"] == "/w/v2"


def test_publish_carries_where_to_fetch_and_refuses_a_bad_address(broker, clients):
    ex = clients(broker, "explorer", "ex")
    tr = clients(broker, "trainer", "tr")
    state = {"version": 1, "method": "checkpoint", "location": "/w/v1", "digest": "abc", "step": 1}
    for bad in ("/w/v1", "tcp://host", "ipc:///tmp/x", "tcp://h:1 ; rm", "tcp://h:0", "tcp://h:70000"):
        with pytest.raises(BrokerError, match="bad_field.*fetch_from"):
            tr.request(P.PUBLISH, {**state, "fetch_from": bad})
    tr.request(P.PUBLISH, {**state, "version": 0, "fetch_from": "tcp://[fd00::5]:5557"})  # IPv6 as ZeroMQ writes it
    tr.request(P.PUBLISH, {**state, "fetch_from": "tcp://trainer-host:5557", "fetch_key": "K" * 40})
    wait_for(lambda: ex.weights and ex.weights["version"] == 1, 5, "version 1 on the bus")
    assert ex.weights["fetch_from"] == "tcp://trainer-host:5557" and ex.weights["fetch_key"] == "K" * 40
    assert clients(broker, "explorer", "late").welcome["weights"]["fetch_from"] == "tcp://trainer-host:5557"


def test_only_the_trainer_fetches_and_one_trainer_at_a_time(broker, clients):
    ex = clients(broker, "explorer", "ex")
    with pytest.raises(BrokerError, match="bad_role"):
        ex.request(P.FETCH, {"step": 0, "max_groups": 1})
    clients(broker, "trainer", "t1")
    with pytest.raises(BrokerError, match="conflict.*one trainer"):  # the refusal itself, not a timeout
        clients(broker, "trainer", "t2")


def test_full_buffer_defers_puts_and_refuses_leases_without_dropping(broker_factory, clients):
    """At capacity, PUTs wait for credit and LEASE says buffer_full; committing frees room and they go on."""
    b = broker_factory("buffer.capacity=4", "rollout.repeat=2", "data.batch_tasks=2")
    ex = clients(b, "explorer", "ex")
    ex.put(group("a") + group("b"), timeout=5)
    assert ex.request(P.LEASE, {"max_tasks": 1, "policy_version": 0}).header["reason"] == "buffer_full"
    pending = ex.put_async(group("c"))
    time.sleep(0.5)
    assert not pending.done()
    tr = clients(b, "trainer", "tr")
    tr.request(P.FETCH, {"step": 0, "max_groups": 2})
    tr.request(P.COMMIT, {"step": 0})
    assert sorted(pending.result(5)["stored"]) == ["c.0", "c.1"]


def test_rollout_settings_reach_peers_and_a_disagreeing_peer_is_refused(broker_factory, raw_dealer):
    b = broker_factory("rollout.temperature=0.7", "rollout.repeat=4")
    sock = raw_dealer(b.address)
    sock.send_multipart(P.encode(P.HELLO, {"role": "explorer", "name": "agrees", "req": 1,
                                           "rollout": {"temperature": 0.7, "dtype": "float32"}}))
    welcome = recv(sock)
    assert welcome.command == P.WELCOME
    assert welcome.header["rollout"] == {"temperature": 0.7, "top_p": 1.0, "max_tokens": 8, "dtype": "float32",
                                         "repeat": 4, "seed": 0, "model": ""}  # no peer has said which model yet
    other = raw_dealer(b.address)
    other.send_multipart(P.encode(P.HELLO, {"role": "explorer", "name": "hotter", "req": 2,
                                            "rollout": {"temperature": 1.0, "repeat": 4}}))
    refused = recv(other)
    assert refused.command == P.ERROR and refused.header["code"] == "conflict"
    assert "rollout.temperature" in refused.header["message"] and "0.7" in refused.header["message"]
    assert "rollout.repeat" not in refused.header["message"]  # the fields that agree are not named
    other.send_multipart(P.encode(P.HELLO, {"role": "explorer", "name": "typo", "req": 3,
                                            "rollout": {"temperature": "hot"}}))
    assert recv(other).header["code"] == "bad_field"


def test_an_auto_dtype_run_takes_the_first_dtype_a_peer_reports_and_keeps_it_across_a_restart(broker_factory,
                                                                                               raw_dealer):
    b = broker_factory("rollout.dtype=auto")

    def hello(name: str, rollout: dict) -> P.Message:
        sock = raw_dealer(b.address)
        sock.send_multipart(P.encode(P.HELLO, {"role": "explorer", "name": name, "req": 1, "rollout": rollout}))
        return recv(sock)

    assert hello("says-nothing", {}).header["rollout"]["dtype"] == "auto"  # nobody has reported one yet
    assert hello("first", {"dtype": "float32"}).header["rollout"]["dtype"] == "float32"
    refused = hello("second", {"dtype": "bfloat16"})
    assert refused.command == P.ERROR and refused.header["code"] == "conflict"
    assert "rollout.dtype: this peer has 'bfloat16', the run 'float32'" in refused.header["message"]
    nonsense = hello("third", {"dtype": "int8"})
    assert nonsense.header["code"] == "bad_field" and "rollout.dtype" in nonsense.header["message"]  # no dtype at all
    assert hello("fourth", {"dtype": "auto"}).header["rollout"]["dtype"] == "float32"  # auto takes the run's
    b.stop()
    b.start()
    assert hello("after-restart", {"dtype": "bfloat16"}).header["code"] == "conflict"
    assert hello("agrees", {"dtype": "float32"}).command == P.WELCOME


def test_the_first_peer_that_names_its_model_fixes_the_runs_and_a_peer_with_another_is_refused(broker_factory,
                                                                                              raw_dealer):
    """`rollout.model` is no setting: each peer reads it from its model's files. The first one given is the run's
    (kept across a restart); a peer with another is refused naming the field and what to do, together with any
    other difference; a peer that leaves it out, or gives "", is not checked. A tool's HELLO is checked as any
    peer's and pins nothing (a process asks so before it loads its model)."""
    b = broker_factory("rollout.temperature=0.7")
    run_model, other = "LlamaForCausalLM 2x128 vocab 49152 #d4fc23dff6cf", "LlamaForCausalLM 2x192 vocab 49152 #0055d"

    def hello(name: str, rollout: dict, role: str = "explorer") -> P.Message:
        sock = raw_dealer(b.address)
        sock.send_multipart(P.encode(P.HELLO, {"role": role, "name": name, "req": 1, "rollout": rollout}))
        return recv(sock)

    assert hello("unknown", {"model": ""}).header["rollout"]["model"] == ""  # leaves it open
    assert hello("asks", {"model": other}, role="tool").header["rollout"]["model"] == ""  # a tool pins nothing
    assert hello("trainer-like", {"model": run_model}).header["rollout"]["model"] == run_model
    assert hello("asks-again", {"model": other}, role="tool").header["code"] == "conflict"  # but is answered
    refused = hello("wrong-model", {"model": other})
    assert refused.command == P.ERROR and refused.header["code"] == "conflict"
    assert refused.header["message"] == (f"rollout.model: this peer has {other!r}, the run {run_model!r}: start it "
                                         f"with the run's model (model.path), or use a new run directory for "
                                         f"another model")
    both = hello("wrong-twice", {"model": other, "temperature": 1.0}).header["message"]
    assert "rollout.model:" in both and "rollout.temperature: this peer has 1.0, the run 0.7" in both
    assert both.endswith("or leave them out to take the run's")
    assert hello("silent", {}).command == P.WELCOME and hello("open", {"model": ""}).command == P.WELCOME
    assert hello("too-long", {"model": "x" * 257}).header["code"] == "bad_field"
    pinned = [e for e in b.log_events() if e["event"] == "rollout_model_pinned"]
    assert [(e["model"], e["peer"]) for e in pinned] == [(run_model, "trainer-like")]
    b.stop()
    b.start()
    assert hello("after-restart", {"model": other}).header["code"] == "conflict"
    assert hello("same", {"model": run_model}).header["rollout"]["model"] == run_model


def test_a_fresh_run_leases_no_task_before_the_explorers_it_waits_for_have_joined(broker_factory, clients):
    b = broker_factory("trainer.wait_for_explorers=2", "trainer.wait_for_explorers_s=60", "rollout.repeat=2")
    first = clients(b, "explorer", "first")
    held = first.request(P.LEASE, {"max_tasks": 1, "policy_version": 0})
    assert held.command == P.WAIT and held.header["reason"] == "explorers"
    awaited = first.request(P.STATUS, {}).header["explorers_awaited"]
    assert awaited == {"expected": 2, "joined": ["first"], "waiting": True}
    second = clients(b, "explorer", "second")
    awaited = first.request(P.STATUS, {}).header["explorers_awaited"]
    assert awaited == {"expected": 2, "joined": ["first", "second"], "waiting": False}
    assert second.request(P.LEASE, {"max_tasks": 1, "policy_version": 0}).command == P.TASKS
    assert first.request(P.LEASE, {"max_tasks": 1, "policy_version": 0}).command == P.TASKS


def test_old_rollout_keys_are_a_clear_config_error():
    from rlbus.common.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="explorer.temperature is now rollout.temperature"):
        load_config(None, ["explorer.temperature=0.5"], environ={})
    assert load_config(None, ["rollout.temperature=0.5"], environ={}).rollout.temperature == 0.5


def test_a_hello_under_a_live_peers_name_is_a_conflict_saying_when_that_peer_would_expire(broker, clients, raw_dealer):
    """Another connection (another `session`) under the name of a live peer: `conflict` with `retry_after_s`,
    at most the liveness window; with the same session it is the same peer reconnecting, and is welcomed."""
    holder = clients(broker, "tool", "taken")
    other = raw_dealer(broker.address)
    other.send_multipart(P.encode(P.HELLO, {"role": "tool", "name": "taken", "session": "not-the-holder", "req": 1}))
    refused = recv(other)
    assert (refused.command, refused.header["code"], refused.header["req"]) == (P.ERROR, "conflict", 1)
    assert refused.header["message"].startswith("name 'taken' belongs to a live tool")
    assert 0 < refused.header["retry_after_s"] <= 5 * 0.2 + 0.5  # the test broker's liveness window, and a turn
    other.send_multipart(P.encode(P.HELLO, {"role": "tool", "name": "taken", "session": holder.session, "req": 2}))
    assert recv(other).command == P.WELCOME


def test_a_stop_signal_ends_the_brokers_wait_at_once_and_its_heap_is_frozen_before_teardown(broker_factory, clients):
    """The loop waits up to half a heartbeat interval for a message (30 s here); SIGTERM ends that wait, not its
    timeout. The index (every stored trajectory's entry) is frozen before the interpreter's teardown would scan
    it: at 200,000 trajectories that took about a second."""
    b = broker_factory("broker.heartbeat_interval_s=60")
    c = clients(b)
    c.put(group("g0", size=2))
    c.close(bye=True)
    os.kill(b.proc.pid, signal.SIGTERM)
    assert b.proc.wait(15) == 0  # the poll's timeout would have ended at 30 s
    events = b.log_events()
    stopping = next(i for i, e in enumerate(events) if e["event"] == "broker_stopping")
    assert events[stopping]["depth"] == 2
    assert any(e["event"] == "heap_frozen" and e.get("ending") for e in events[stopping:])


def test_a_trainer_that_took_its_last_step_ends_the_run_for_every_explorer_until_a_trainer_returns(broker_factory,
                                                                                                    clients):
    """Explorers on other hosts waited for ever for a version no trainer would publish. A trainer's BYE `finished`
    ends the run: LEASE is answered DONE `finished`, the bus and WELCOME say `finished`, across a restart too; a
    trainer's HELLO, or a PUBLISH, reopens it."""
    b = broker_factory("data.batch_tasks=2", "rollout.repeat=2")
    ex = clients(b, "explorer", "ex")
    tr = clients(b, "trainer", "tr")
    assert ex.request(P.LEASE, {"max_tasks": 1, "policy_version": 0}).command == P.TASKS
    tr.close(bye=True)  # a trainer stopped before its last step ends nothing
    wait_for(lambda: any(e["event"] == "peer_left" and e["peer"] == "tr" for e in b.log_events()), 5, "tr gone")
    assert ex.request(P.LEASE, {"max_tasks": 1, "policy_version": 0}).command == P.TASKS
    assert not ex.weights.get("finished")
    tr = clients(b, "trainer", "tr")
    tr.close(bye={"finished": True})
    wait_for(lambda: ex.weights and ex.weights.get("finished"), 5, "the bus saying the run is over")
    done = ex.request(P.LEASE, {"max_tasks": 1, "policy_version": 0})
    assert (done.command, done.header.get("reason")) == (P.DONE, "finished")
    assert [e["event"] for e in b.log_events() if e["event"].startswith("run_")] == ["run_finished"]

    b.kill()
    b.start()  # the same directory: the run is still over
    late = clients(b, "explorer", "late")
    assert late.welcome["weights"]["finished"] is True
    assert late.request(P.LEASE, {"max_tasks": 1, "policy_version": 0}).command == P.DONE
    clients(b, "trainer", "tr")  # a trainer back (say, for more steps): the run goes on
    wait_for(lambda: not late.weights.get("finished"), 5, "the bus saying the run goes on")
    again = late.request(P.LEASE, {"max_tasks": 1, "policy_version": 0})  # batch 0's tasks are ex's: batch 1's
    assert (again.command, again.header.get("need_version")) == (P.WAIT, 1), again.header  # wait for version 1
    assert [e["event"] for e in b.log_events() if e["event"].startswith("run_")] == ["run_finished", "run_reopened"]


def test_a_bye_whose_finished_is_not_a_boolean_is_a_bad_field(broker, raw_dealer):
    d = raw_dealer(broker.address)
    d.send_multipart(P.encode(P.HELLO, {"req": 1, "role": "trainer", "name": "tr"}))
    assert recv(d).command == P.WELCOME
    d.send_multipart(P.encode(P.BYE, {"finished": "yes"}))
    reply = recv(d)
    assert reply.command == P.ERROR and reply.header["code"] == "bad_field" and "finished" in reply.header["message"]


@pytest.mark.parametrize("style", ["async", "lockstep"])
def test_once_the_taskset_is_done_and_trained_on_a_fetch_is_told_exhausted_at_once(broker_factory, clients, tmp_path,
                                                                                    style):
    """A finite taskset of three tasks, batches of two: the last batch takes what is left, however few its groups
    (async: a FETCH asking for two gets the one), and the FETCH after it is answered EMPTY `exhausted` at once,
    though it would wait 30 s, so a trainer whose total_steps the taskset cannot fill does not wait for ever."""
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(f'{{"prompt": "{i} + {i}", "answer": "{2 * i}"}}\n' for i in range(3)))
    b = broker_factory(f"sync.sync_style={style}", "sync.max_staleness=4", "data.taskset=file", f"data.path={path}",
                       "data.batch_tasks=2", "rollout.repeat=2")
    ex = clients(b, "explorer", "ex")
    tr = clients(b, "trainer", "tr")
    by_step = {0: (0, 1), 1: (2,)}
    for step, seqs in by_step.items():
        if style == "lockstep" and step == 1:
            tr.request(P.PUBLISH, {"version": 1, "method": "checkpoint", "location": "/w/v1", "digest": "d",
                                   "step": 1})
        tasks = ex.request(P.LEASE, {"max_tasks": 2, "policy_version": step}).header["tasks"]
        assert [t["seq"] for t in tasks] == list(seqs)
        for t in tasks:
            ex.put(group(t["lease_id"], 2, version=step, batch=t["batch_index"]), timeout=10)
        fetch = {"step": step, "max_groups": 2, "wait_ms": 30_000,
                 **({"batch_index": step} if style == "lockstep" else {"min_groups": 2})}
        reply = tr.request(P.FETCH, fetch, timeout=10)
        assert reply.command == P.BATCH and len(reply.header["groups"]) == len(seqs)
    done = ex.request(P.LEASE, {"max_tasks": 2, "policy_version": 1})
    assert (done.command, done.header["reason"]) == (P.DONE, "taskset")
    started = time.monotonic()
    fetch = {"step": 2, "max_groups": 2, "wait_ms": 30_000, **({"batch_index": 2} if style == "lockstep" else {})}
    reply = tr.request(P.FETCH, fetch, timeout=10)
    assert (reply.command, reply.header["reason"]) == (P.EMPTY, "exhausted")
    assert time.monotonic() - started < 5, "not held: nothing it could wait for will come"
    short = [e for e in b.log_events() if e["event"] == "taskset_short"]  # said at start: 3 tasks of 200 wanted
    assert [(e["tasks"], e["tasks_wanted"], e["steps"]) for e in short] == [(3, 200, 2)]

"""The shared client: heartbeats keep idle peers alive, reconnects resend, timeouts are bounded."""

from __future__ import annotations

import os
import resource
import signal
import socket
import threading
import time

import pytest
import zmq
from structlog.testing import capture_logs

from rlbus.common import protocol as P
from rlbus.common.client import BrokerClient, BrokerError, BrokerUnreachable, default_name
from tests.conftest import group, recv, traj
from tests.helpers.waiting import wait_for


def test_idle_client_stays_registered_through_heartbeats(broker, clients):
    """A peer that sends no requests for several liveness periods is not dropped."""
    quiet = clients(broker, "explorer", "quiet")
    time.sleep(0.2 * 5 * 3)  # three times liveness x interval
    tool = clients(broker, "tool", "look")
    assert "quiet" in {p["name"] for p in tool.request(P.STATUS).header["peers"]}
    assert quiet.reconnects == 0


def test_put_made_while_broker_is_down_is_stored_after_restart(broker, clients):
    """Requests wait through a broker restart, are resent after HELLO, and complete."""
    c = clients(broker, "explorer", "patient")
    broker.kill(signal.SIGKILL)
    pending = c.put_async(group("late"))
    time.sleep(1.5)  # long enough for the client to notice and start reconnecting
    assert not pending.done()
    broker.start()
    assert sorted(pending.result(20)["stored"]) == ["late.0", "late.1"]
    assert c.reconnects >= 1


def test_a_broker_restarted_on_another_buffer_directory_is_rejoined_with_a_warning_that_says_so(broker, clients,
                                                                                               tmp_path):
    """A broker restarted on a fresh directory (a new run id) was rejoined without a word, though its buffer,
    tasks and leases are not the run the peer was part of; a restart on its own directory says nothing."""
    c = clients(broker, "explorer", "rejoins")
    first = c.welcome["run_id"]
    with capture_logs() as logs:
        broker.kill(signal.SIGKILL)
        broker.start()  # the same directory: the same run
        assert c.request(P.STATUS, timeout=30).header["run_id"] == first  # answered once it has said HELLO again
        assert not [e for e in logs if e["event"] == "broker_run_changed"]
        broker.kill(signal.SIGKILL)
        os.rename(broker.data_dir, tmp_path / "the-first-run")
        broker.data_dir.mkdir()
        broker.start()
        assert c.request(P.STATUS, timeout=30).header["run_id"] != first
    changed = [e for e in logs if e["event"] == "broker_run_changed"]
    assert len(changed) == 1 and changed[0]["was"] == first and changed[0]["now"] == c.welcome["run_id"] != first


def test_default_names_are_unique_to_each_start_and_say_whose_they_are():
    """No two peers a process starts share a name (a random tag alone repeats: 24 bits in 20,000 draws)."""
    names = {default_name("explorer") for _ in range(20_000)}
    assert len(names) == 20_000
    assert all(n.startswith(f"explorer-{socket.gethostname()}-{os.getpid()}-") for n in names)


def test_request_timeout_is_bounded():
    c = BrokerClient("tcp://127.0.0.1:1", "tool", "nobody", heartbeat_interval_s=0.1)
    with pytest.raises(TimeoutError, match="no WELCOME"):
        c.start(0.5)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="STATUS"):
        c.request(P.STATUS, timeout=0.3)
    assert time.monotonic() - t0 < 2
    c.close(bye=False, timeout=1)


def test_close_fails_outstanding_requests_instead_of_leaving_them_waiting(broker, clients):
    """A FETCH held at the broker when the client says BYE ends with an error, not a hang."""
    t = clients(broker, "trainer", "leaving")
    pending = t.submit(P.FETCH, {"step": 0, "max_groups": 1, "wait_ms": 60000})
    time.sleep(0.2)
    t.close(bye=True)
    with pytest.raises(ConnectionError, match="BYE"):
        pending.result(5)


def test_a_stopping_client_gives_up_on_a_broker_that_has_gone(broker, clients):
    """Before stopping() the client waits out a broker restart (above); after it, a silent broker fails
    what waits, and what comes later, with BrokerUnreachable instead of reconnecting forever."""
    c = clients(broker, "explorer", "leaving")
    c.stopping()
    broker.kill(signal.SIGKILL)
    pending = c.put_async(group("unsaid"))
    with pytest.raises(BrokerUnreachable, match="went silent while leaving was stopping"):
        pending.result(30)
    with pytest.raises(BrokerUnreachable, match="stopped"):
        c.request(P.STATUS, timeout=5)


def test_a_stopping_client_with_nothing_waiting_outlasts_a_broker_that_pauses(broker, clients):
    """An explorer finishing its last batch (stopping, nothing asked yet) while a loaded host starves the broker
    past the liveness window: that costs a reconnect, not the batch."""
    c = clients(broker, "explorer", "patient")
    c.stopping()
    os.kill(broker.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(0.2 * 5 * 3)  # three times liveness x interval without a word from the broker
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)
    assert sorted(c.put(group("finished"), timeout=10)["stored"]) == ["finished.0", "finished.1"]


def test_a_stopping_client_still_finishes_with_a_broker_that_answers(broker, clients):
    c = clients(broker, "explorer", "tidy")
    c.stopping()
    time.sleep(0.2 * 5 * 2)  # twice liveness x interval: heartbeats keep it alive
    assert sorted(c.put(group("last"), timeout=10)["stored"]) == ["last.0", "last.1"]


def refused_for_storage(broker) -> int:
    return sum(1 for e in broker.log_events() if e["event"] == "request_refused" and e["code"] == "storage_error")


def test_a_put_the_broker_could_not_write_is_resent_until_stored_and_given_up_on_once_stopping(broker, clients):
    """A broker that cannot write (here: a file size limit, as a full disk) answers `storage_error`; the client
    resends that PUT after a backoff until it is stored, and its caller sees only the ACK. Once the peer is
    stopping, a refusal fails the PUT instead, so that a stopping peer does not wait on a disk."""
    limit = 2 << 20  # the first segment's first 2 MiB: a PUT of 3 MiB cannot be written
    resource.prlimit(broker.proc.pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    c = clients(broker, "explorer", "persistent", backoff_max_s=0.2)
    big = [traj(f"big.{i}", "big", 2, payload=bytes([i]) * (3 << 19)) for i in range(2)]
    pending = c.put_async(big)
    wait_for(lambda: refused_for_storage(broker) >= 3, 10, "three refusals")
    assert not pending.done()
    resource.prlimit(broker.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert sorted(pending.result(10)["stored"]) == ["big.0", "big.1"]
    trainer = clients(broker, "trainer", "tr")
    batch = trainer.request(P.FETCH, {"step": 0, "max_groups": 1})
    assert [bytes(p) for p in P.split_payloads(batch.header["groups"][0]["trajectories"], batch.payloads)] == \
        [p for _, p in big]

    resource.prlimit(broker.proc.pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))  # past it now
    c.stopping()
    with pytest.raises(BrokerError, match="storage_error"):
        c.put([traj(f"late.{i}", "late", 2, payload=bytes(3 << 19)) for i in range(2)], timeout=10)


def test_a_lease_the_broker_could_not_record_leases_nothing_and_is_resent_until_it_can(broker, clients):
    """A broker whose catalogue cannot be written (the limit lies below where its next record goes, above its
    logs) answers a LEASE `storage_error` with nothing leased; the client resends it, and once the broker can
    write, the tasks granted are the ones the first LEASE would have had."""
    c = clients(broker, "explorer", "patient", backoff_max_s=0.2)
    tool = clients(broker, "tool", "look")
    limit_below_the_catalogues_next_record(broker)
    pending = c.submit(P.LEASE, {"max_tasks": 2, "policy_version": 0})
    wait_for(lambda: refused_for_storage(broker) >= 3, 10, "three refusals")
    assert not pending.done()
    assert tool.request(P.STATUS).header["tasks"] == {"issued": 0, "leased": 0, "done": 0, "revisits": 0}
    lift_limit(broker)
    reply = pending.result(10)
    assert reply.command == P.TASKS and [t["lease_id"] for t in reply.header["tasks"]] == ["t0.0", "t1.0"]
    assert tool.request(P.STATUS).header["tasks"]["leased"] == 2


def limit_below_the_catalogues_next_record(broker) -> None:
    """A file size limit on the broker above its logs (with room for a few lines) and below where its catalogue
    writes next: the catalogue cannot be written, as on a full disk; its segments, logs and reads go on."""
    logs = max((broker.data_dir / name).stat().st_size for name in ("broker.jsonl", "broker.stderr"))
    limit = logs + (16 << 10)
    assert (broker.data_dir / "buffer.sqlite3-wal").stat().st_size > limit, "the catalogue's next record lies past it"
    resource.prlimit(broker.proc.pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))


def lift_limit(broker) -> None:
    resource.prlimit(broker.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def test_a_fetch_a_commit_or_a_publish_the_broker_could_not_record_is_resent_until_it_can(broker, clients, tmp_path):
    """The trainer's FETCH, COMMIT and PUBLISH are recorded in the catalogue before they change anything. A broker
    that cannot write them answers `storage_error` with nothing changed, the client resends, and once the broker
    can write, each is answered as the first would have been: the batch, the commit, the new version."""
    ex = clients(broker, "explorer", "ex")
    assert len(ex.put(group("g0") + group("g1"), timeout=5)["stored"]) == 4
    tr = clients(broker, "trainer", "tr", backoff_max_s=0.2)
    tool = clients(broker, "tool", "look")
    steps = [(P.FETCH, {"step": 0, "max_groups": 4, "min_groups": 2}), (P.COMMIT, {"step": 0}),
             (P.PUBLISH, {"version": 1, "method": "checkpoint", "location": str(tmp_path), "digest": "d1"})]
    for command, header in steps:
        before, seen = tool.request(P.STATUS).header, refused_for_storage(broker)
        limit_below_the_catalogues_next_record(broker)
        pending = tr.submit(command, header)
        wait_for(lambda: refused_for_storage(broker) >= seen + 3, 10, f"three refusals of {command}")
        assert not pending.done()
        now = tool.request(P.STATUS).header
        assert (now["buffer"], now["weights"]) == (before["buffer"], before["weights"]), f"{command} changed them"
        lift_limit(broker)
        reply = pending.result(10)
        if command == P.FETCH:
            assert reply.command == P.BATCH and sorted(g["group_id"] for g in reply.header["groups"]) == ["g0", "g1"]
        else:
            assert reply.command == P.OK
    status = tool.request(P.STATUS).header
    assert status["buffer"]["committed"] == 4 and status["weights"]["version"] == 1
    # The bus carries the version to the explorer on a socket of its own: it may come after the trainer's reply.
    wait_for(lambda: ex.weights["version"] == 1, 10, "the explorer to hear of version 1 on the bus")
    assert broker.proc.poll() is None


def test_a_hello_that_would_pin_the_runs_dtype_is_retried_until_the_broker_can_record_it(broker_factory, clients):
    """The first explorer of a `rollout.dtype: auto` run pins its dtype for the run, recorded before anything
    changes. A broker that cannot write it answers HELLO `storage_error` with `retry_after_s`, and the peer is not
    joined; the client says HELLO again after that long, and once the broker can write, it joins and the run's
    dtype is the one it reported."""
    b = broker_factory("rollout.dtype=auto")
    tool = clients(b, "tool", "look")
    assert tool.welcome["rollout"]["dtype"] == "auto"
    limit_below_the_catalogues_next_record(b)
    first = BrokerClient(b.address, "explorer", "first", bus_address=b.bus, heartbeat_interval_s=0.2,
                         rollout={"dtype": "bfloat16"})
    starting = threading.Thread(target=first.start, args=(30,), daemon=True)
    try:
        starting.start()
        wait_for(lambda: refused_for_storage(b) >= 3, 10, "three refusals of HELLO")
        refused = [e for e in b.log_events() if e["event"] == "request_refused"]
        assert {e["command"] for e in refused} == {P.HELLO} and starting.is_alive()
        assert "first" not in {p["name"] for p in tool.request(P.STATUS).header["peers"]}
        lift_limit(b)
        starting.join(10)
        assert not starting.is_alive() and first.welcome["rollout"]["dtype"] == "bfloat16"
        assert "first" in {p["name"] for p in tool.request(P.STATUS).header["peers"]}
        pinned = [e for e in b.log_events() if e["event"] == "rollout_dtype_pinned"]
        assert [(e["dtype"], e["peer"]) for e in pinned] == [("bfloat16", "first")] and b.proc.poll() is None
    finally:
        first.close(bye=False, timeout=1)


def test_a_peer_dropped_while_the_disk_refuses_writes_still_gives_its_tasks_back(broker, clients, raw_dealer):
    """Releasing a dropped peer's leases is not a request anyone could resend: with the catalogue unwritable, the
    broker releases them all the same (logged `catalog_behind`) and goes on serving; once it can write, the
    next LEASE gets those tasks."""
    sock = raw_dealer(broker.address)
    sock.send_multipart(P.encode(P.HELLO, {"role": "explorer", "name": "gone", "session": "s-gone", "req": 1}))
    assert recv(sock).command == P.WELCOME
    sock.send_multipart(P.encode(P.LEASE, {"req": 2, "max_tasks": 2, "policy_version": 0}))
    assert [t["lease_id"] for t in recv(sock).header["tasks"]] == ["t0.0", "t1.0"]
    sock.close(0)
    tool = clients(broker, "tool", "look")
    limit_below_the_catalogues_next_record(broker)
    wait_for(lambda: "gone" not in {p["name"] for p in tool.request(P.STATUS).header["peers"]}, 5, "gone dropped")
    assert tool.request(P.STATUS).header["tasks"]["leased"] == 0
    behind = [e for e in broker.log_events() if e["event"] == "catalog_behind"]
    assert [(e["change"], e["seqs"]) for e in behind] == [("release", [0, 1])]
    lift_limit(broker)
    other = clients(broker, "explorer", "other")
    again = other.request(P.LEASE, {"max_tasks": 2, "policy_version": 0}).header["tasks"]
    assert [t["lease_id"] for t in again] == ["t0.1", "t1.1"] and broker.proc.poll() is None


class StandIn:
    """A ROUTER on loopback that plays the broker's side by hand (a unit test of the client's reconnect logic;
    the real broker's side of the same is in tests/explorer/test_inflight.py, an explorer stalled past liveness)."""

    def __init__(self):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.peer = b""

    def next(self, timeout_s: float = 5.0) -> P.Message | None:
        """The next message other than HEARTBEAT, or None if none comes within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            self.peer, *frames = self.sock.recv_multipart()
            msg = P.decode(frames)
            if msg.command != P.HEARTBEAT:
                return msg
        return None

    def answer(self, command: str, header: dict) -> None:
        self.sock.send_multipart([self.peer, *P.encode(command, header)])

    def welcome(self, hello: P.Message) -> None:
        self.answer(P.WELCOME, {"req": hello.header["req"], "run_id": "r", "started_at": 0.0, "peer": "forgotten",
                                "heartbeat_interval_s": 0.2, "liveness": 50, "credit": 8, "max_message_bytes": 1 << 20,
                                "weights": {"version": 0, "method": "checkpoint", "location": "", "digest": ""},
                                "sync": {}, "rollout": {}})


def test_a_client_the_broker_forgot_says_hello_once_and_resends_each_request_once():
    """Told `not_registered` for several messages in a row (a broker that dropped it, all of them sent before the
    first answer came), the client says HELLO once, not once per refusal; and a WELCOME to a HELLO that is not
    its latest resends nothing. Each WELCOME it takes resends every unanswered request, so a second one would
    send the same LEASE twice, and a broker grants a request it sees twice on one connection twice."""
    broker = StandIn()
    client = BrokerClient(broker.address, "explorer", "forgotten", heartbeat_interval_s=0.2)
    starting = threading.Thread(target=client.start, args=(10,))
    starting.start()
    first = broker.next()
    broker.welcome(first)
    starting.join(10)
    try:
        pending = client.submit(P.LEASE, {"max_tasks": 2, "policy_version": 0})
        lease = broker.next()
        assert lease.command == P.LEASE
        refusal = {"code": "not_registered", "message": "say HELLO first"}
        for header in (dict(refusal, req=lease.header["req"]), refusal, refusal):  # the LEASE, two HEARTBEATs
            broker.answer(P.ERROR, header)
        hello = broker.next()
        assert hello.command == P.HELLO and broker.next(1.0) is None, "one HELLO, however many refusals"
        broker.welcome(hello)
        again = broker.next()
        assert (again.command, again.header["req"]) == (P.LEASE, lease.header["req"])
        broker.welcome(first)  # a late WELCOME to the first HELLO
        assert broker.next(1.0) is None, "resent once"
        broker.answer(P.TASKS, {"req": again.header["req"], "tasks": [], "lease_s": 60.0})
        assert pending.result(5).command == P.TASKS
    finally:
        client.close(bye=False, timeout=1)
        broker.sock.close(0)


def test_a_broker_that_does_not_answer_is_named_with_the_likely_reason():
    """A host name that does not resolve is said so; an address nobody serves asks whether the broker runs."""
    nowhere = BrokerClient("tcp://no-such-host.invalid:5555", "tool")
    try:
        with pytest.raises(TimeoutError, match="its host 'no-such-host.invalid' does not resolve here"):
            nowhere.start(0.5)
    finally:
        nowhere.close(bye=False, timeout=1)
    silent = BrokerClient("tcp://127.0.0.1:1", "tool", heartbeat_interval_s=0.05, liveness=2)
    try:
        with capture_logs() as logs:
            with pytest.raises(TimeoutError, match=r"tcp://127.0.0.1:1 within 2 s; is it running\?"):
                silent.start(2)
    finally:
        silent.close(bye=False, timeout=1)
    # Its log says which broker it tries to reach.
    assert any(e["event"] == "broker_unreachable" and e["address"] == "tcp://127.0.0.1:1" for e in logs)


def test_a_client_whose_socket_cannot_open_fails_its_start_with_the_reason_not_a_timeout():
    """The I/O thread's failure reaches the caller waiting for WELCOME (it waited out the whole timeout)."""
    client = BrokerClient("tcp://a b:1", "tool")  # ZeroMQ refuses the address itself
    with pytest.raises(RuntimeError, match=r"broker client thread failed \(ZMQError: Invalid argument"):
        client.start(60)
    with pytest.raises(BrokerUnreachable):
        client.request(P.STATUS, timeout=60)


def test_a_hello_refused_until_starts_time_runs_out_is_that_refusal_not_a_timeout():
    """A name a live peer holds is retried after `retry_after_s` (the holder may expire); when start's time runs
    out with the retry unanswered, the caller gets the broker's refusal, not a timeout that asks whether the
    broker runs. (The real broker's refusal itself: tests/broker/test_broker.py.)"""
    broker = StandIn()
    client = BrokerClient(broker.address, "tool", "taken", heartbeat_interval_s=0.2)
    try:
        outcome: list[BaseException] = []

        def start() -> None:
            try:
                client.start(2)
            except BaseException as exc:  # noqa: BLE001 (the test reads it)
                outcome.append(exc)

        starting = threading.Thread(target=start)
        starting.start()
        hello = broker.next()
        broker.answer(P.ERROR, {"req": hello.header["req"], "code": "conflict", "retry_after_s": 0.5,
                                "message": "name 'taken' belongs to a live tool"})
        assert broker.next().command == P.HELLO  # the retry, left unanswered
        starting.join(10)
        assert len(outcome) == 1 and isinstance(outcome[0], BrokerError), outcome
        assert str(outcome[0]) == "conflict: name 'taken' belongs to a live tool"
    finally:
        client.close(bye=False, timeout=1)
        broker.sock.close(0)


def test_stopping_gives_up_a_fetch_the_broker_holds_and_loses_nothing(broker, clients):
    """A trainer told to stop while the broker holds its FETCH for data (up to `wait_ms`) ends the wait at once;
    the next trainer's FETCH of that step gets the batch."""
    from concurrent.futures import CancelledError

    trainer = clients(broker, "trainer", "leaving")
    waiting: list[BaseException] = []

    def fetch() -> None:
        try:
            trainer.request(P.FETCH, {"step": 0, "max_groups": 1, "wait_ms": 60_000}, timeout=90)
        except BaseException as exc:
            waiting.append(exc)

    thread = threading.Thread(target=fetch)
    thread.start()
    wait_for(lambda: trainer._waits, 10, "the FETCH sent")
    thread.join(0.5)
    assert thread.is_alive()  # held by the broker: nothing to deliver yet
    trainer.stopping(give_up=(P.FETCH,))
    thread.join(10)  # not the 60 s the broker would hold it
    assert not thread.is_alive() and isinstance(waiting[0], CancelledError)
    with pytest.raises(CancelledError):  # and any later one at once
        trainer.request(P.FETCH, {"step": 0, "max_groups": 1, "wait_ms": 60_000}, timeout=90)
    assert trainer.request(P.STATUS).command == P.STATUS  # other requests are still answered
    trainer.close(bye=True)
    clients(broker, "explorer", "late").put(group("g"))
    again = clients(broker, "trainer", "back")
    reply = again.request(P.FETCH, {"step": 0, "max_groups": 1, "wait_ms": 5_000}, timeout=30)
    assert reply.command == P.BATCH
    assert [t["id"] for g in reply.header["groups"] for t in g["trajectories"]] == ["g.0", "g.1"]


def test_asking_whether_a_peer_would_be_admitted_pins_nothing_and_a_broker_away_refuses_nothing(broker_factory,
                                                                                                clients):
    """`check_admission`, which explorers and trainers call before they load their model: the broker's refusal,
    in its words; no answer within the wait is no refusal; an admitted ask leaves no peer behind."""
    from rlbus.common.broker_config import BrokerConfig
    from rlbus.common.client import check_admission
    from tests.conftest import free_port

    b = broker_factory()
    here, away = BrokerConfig(address=b.address), BrokerConfig(address=f"tcp://127.0.0.1:{free_port()}")
    run, other = {"model": "M 2x128 vocab 9 #a", "dtype": "float32"}, {"model": "M 2x192 vocab 9 #b"}
    with capture_logs() as logs:
        check_admission(here, other, wait_s=10)  # a fresh run: admitted, and still open
        clients(b, "trainer", "tr", rollout=run)
        check_admission(here, run, wait_s=10)
        with pytest.raises(BrokerError, match=r"^conflict: rollout\.model: this peer has 'M 2x192 .*the run 'M 2x128"):
            check_admission(here, other, wait_s=10)
        check_admission(away, other, wait_s=0.3)
    refused = [e for e in logs if e["event"] == "hello_refused"]
    assert [e["file_only"] for e in refused] == [True]  # the caller says it (a command as its `error: ...` line)
    pinned = [e["peer"] for e in b.log_events() if e["event"] == "rollout_model_pinned"]
    assert pinned == ["tr"]
    tool = clients(b, "tool", "look")
    assert {p["name"] for p in tool.request(P.STATUS).header["peers"]} == {"tr", "look"}


def test_clients_made_one_after_another_in_one_process_each_have_an_address_of_their_own():
    """A client wakes its I/O thread over an inproc address. Named by id(), a client made just after another was
    closed could get its id while ZeroMQ still held that address, and failed with `Address already in use` (an
    explorer's admission check, then its own client)."""
    for _ in range(300):
        client = BrokerClient("tcp://127.0.0.1:1", "tool")
        client.close(bye=False)
        del client

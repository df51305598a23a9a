"""Hostile but small messages: each gets ERROR (or its documented answer), and the broker goes on.

Every case here once stopped a broker, wedged its writes or broke exactly-once;
after each, a well-behaved peer must still be served and the broker's process
must still be alive, also after a restart on the same data.
"""

from __future__ import annotations

import msgpack
import pytest

from rlbus.common import protocol as P
from rlbus.common.client import BrokerError
from tests.conftest import group, nested, recv


def hello(sock, name="raw", role="explorer", **extra):
    sock.send_multipart(P.encode(P.HELLO, {"role": role, "name": name, "req": 1, **extra}))
    return recv(sock)


def served(b, clients, name="good") -> None:
    """The broker is alive and serves another peer a PUT and a STATUS."""
    assert b.proc.poll() is None, "the broker process died"
    good = clients(b, "explorer", name)
    assert good.put(group(f"{name}-g"), timeout=5)["stored"] == [f"{name}-g.0", f"{name}-g.1"]
    assert good.request(P.STATUS, timeout=5).command == P.STATUS


UNREGISTERED = {
    # A wrong-typed field nested ~1000 deep: the error message once repr'd it past the recursion limit.
    "deep_wrong_type": ([P.PROTOCOL, b"LEASE", P.pack({"req": 3, "max_tasks": [nested(900)], "policy_version": 0})],
                        {"malformed", "bad_field"}),
    "deep_info_in_hello": (P.encode(P.HELLO, {"req": 3, "role": "explorer", "name": "deep",
                                              "capabilities": nested(300)}), {"malformed"}),
    "services_not_strings": (P.encode(P.HELLO, {"req": 3, "role": "reward", "name": "rw",
                                                "capabilities": {"services": [1, {"x": 2}]}}), {"bad_field"}),
    "nil_optional_field": (P.encode(P.HELLO, {"req": 3, "role": "explorer", "name": "n", "host": None}),
                           {"bad_field"}),
    "huge_int": (P.encode(P.LEASE, {"req": 3, "max_tasks": 1 << 63, "policy_version": 0}), {"bad_field"}),
    # An extension value kept in capabilities failed every STATUS after it (the broker cannot re-emit it).
    "timestamp_in_capabilities": ([P.PROTOCOL, b"HELLO", msgpack.packb({"req": 3, "role": "explorer", "name": "t",
                                   "capabilities": {"since": msgpack.Timestamp(5, 0)}})], {"malformed"}),
}


@pytest.mark.parametrize("case", sorted(UNREGISTERED))
def test_hostile_message_from_any_socket_gets_error(broker_factory, raw_dealer, clients, case):
    b = broker_factory()
    sock = raw_dealer(b.address)
    frames, codes = UNREGISTERED[case]
    sock.send_multipart(frames)
    reply = recv(sock)
    assert reply.command == P.ERROR and reply.header["code"] in codes, reply.header
    assert reply.header.get("req") == 3, "the ERROR answers the request it refuses"
    served(b, clients)


def test_nil_in_optional_fetch_fields_is_a_type_error(broker_factory, clients):
    b = broker_factory()
    tr = clients(b, "trainer", "tr")
    for field in ("min_groups", "wait_ms", "batch_index"):
        with pytest.raises(BrokerError, match=f"bad_field.*{field}.*nil"):
            tr.request(P.FETCH, {"step": 0, "max_groups": 1, field: None})
    served(b, clients)


def test_unicode_digit_group_id_is_stored_and_served(broker_factory, clients):
    """`t²` and friends once reached int() through str.isdigit in the task queue."""
    b = broker_factory()
    ex = clients(b, "explorer", "ex")
    assert ex.put(group("t\u00b2.0"), timeout=5)["stored"] == ["t\u00b2.0.0", "t\u00b2.0.1"]
    assert ex.put(group("t1\u0663.0"), timeout=5)["stored"]
    served(b, clients)


def test_deep_info_cannot_poison_the_buffer(broker_factory, raw_dealer, clients, tmp_path):
    """Nesting the broker would store and later fail to re-emit (BATCH, STATUS, WELCOME) is refused up front."""
    b = broker_factory(data_dir=tmp_path / "b")
    sock = raw_dealer(b.address)
    assert hello(sock).command == P.WELCOME
    (meta, payload), = group("deep", size=1)
    meta = {**meta, "info": nested(P.MAX_DEPTH + 5), "payload_bytes": len(payload)}
    sock.send_multipart(P.encode(P.PUT, {"req": 4, "trajectories": [meta]}, [payload]))
    assert recv(sock).header["code"] == "malformed"
    tr = clients(b, "trainer", "tr")
    bcast = {"epoch": 1, "backend": "gloo", "address": "127.0.0.1:1", "world": 2, "ranks": {"x": nested(40)},
             "version": 1, "digest": "d", "timeout_s": 5.0}
    with pytest.raises(BrokerError, match="malformed"):
        tr.request(P.PUBLISH, {"version": 1, "method": "nccl", "location": "", "digest": "d", "broadcast": bcast})
    b.stop()
    b.start()
    served(b, clients)
    assert clients(b, "tool", "st").request(P.STATUS, timeout=5).header["weights"]["version"] == 0


def test_an_extension_value_in_a_put_is_refused_before_it_reaches_the_writer(broker_factory, raw_dealer, clients):
    """A timestamp in a PUT's `info` once reached the writer, which could not encode it: the whole group commit
    (every PUT in it, of any explorer) failed as a `storage_error`, and its sender was told to resend for ever.
    Another extension type was stored as a list, so the trainer got back something else than was sent."""
    b = broker_factory()
    sock = raw_dealer(b.address)
    assert hello(sock).command == P.WELCOME
    (meta, payload), = group("ext", size=1)
    for req, value in ((4, msgpack.Timestamp(5, 0)), (5, msgpack.ExtType(5, b"ab"))):
        header = {"req": req, "trajectories": [{**meta, "info": {"at": value}, "payload_bytes": len(payload)}]}
        sock.send_multipart([P.PROTOCOL, P.PUT.encode(), msgpack.packb(header), payload])
        reply = recv(sock)
        assert (reply.command, reply.header["code"], reply.header["req"]) == (P.ERROR, "malformed", req)
        assert "extension" in reply.header["message"]
    served(b, clients)
    assert clients(b, "tool", "st").request(P.STATUS, timeout=5).header["buffer"]["stored"] == 2


def test_publish_broadcast_needs_its_fields_before_anything_is_stored(broker_factory, clients):
    b = broker_factory()
    tr = clients(b, "trainer", "tr")
    with pytest.raises(BrokerError, match="bad_field.*epoch"):
        tr.request(P.PUBLISH, {"version": 1, "method": "nccl", "location": "", "digest": "d",
                               "broadcast": {"backend": "gloo"}})
    assert tr.request(P.STATUS).header["weights"]["version"] == 0
    served(b, clients)


def test_fetch_steps_cannot_overflow_or_skip_ahead(broker_factory, clients):
    """A step past 2^53 is a bad field; a step that skips ahead would retire every group and wedge admission."""
    b = broker_factory("sync.sync_style=async")
    ex = clients(b, "explorer", "ex")
    ex.put(group("g"), timeout=5)
    tr = clients(b, "trainer", "tr")
    with pytest.raises(BrokerError, match="bad_field"):
        tr.request(P.FETCH, {"step": 1 << 63, "max_groups": 1})
    batch = tr.request(P.FETCH, {"step": 0, "max_groups": 1})
    with pytest.raises(BrokerError, match="conflict.*one at a time"):
        tr.request(P.FETCH, {"step": 1 << 52, "max_groups": 1})
    assert [g["group_id"] for g in batch.header["groups"]] == ["g"]
    assert ex.request(P.LEASE, {"max_tasks": 1, "policy_version": 0}).command == P.TASKS


def test_empty_last_payload_does_not_stop_writes(broker_factory, clients):
    """A zero-length payload at the end of a PUT once sent the writer into an endless loop."""
    b = broker_factory()
    ex = clients(b, "explorer", "ex")
    items = group("e", size=2)
    items[1] = (items[1][0], b"")
    assert ex.put(items, timeout=5)["stored"] == ["e.0", "e.1"]
    served(b, clients)


def test_two_fetches_of_one_step_get_the_same_batch(broker_factory, clients):
    b = broker_factory("sync.sync_style=async")
    tr = clients(b, "trainer", "tr")
    first = tr.submit(P.FETCH, {"step": 0, "max_groups": 1, "wait_ms": 5000})
    second = tr.submit(P.FETCH, {"step": 0, "max_groups": 1, "wait_ms": 5000})
    ex = clients(b, "explorer", "ex")
    ex.put(group("a"), timeout=5)
    ex.put(group("b"), timeout=5)
    got = [f.result(10) for f in (first, second)]
    assert [[g["group_id"] for g in m.header["groups"]] for m in got] == [["a"], ["a"]]
    tr.request(P.COMMIT, {"step": 0})
    nxt = tr.request(P.FETCH, {"step": 1, "max_groups": 1})
    assert [g["group_id"] for g in nxt.header["groups"]] == ["b"], "the other group was not spent on step 0"


def test_trajectory_for_a_complete_group_is_refused(broker_factory, clients):
    b = broker_factory("sync.sync_style=async")
    ex = clients(b, "explorer", "ex")
    ex.put(group("full"), timeout=5)
    extra = group("full", size=2)
    extra = [({**extra[0][0], "id": "full.9"}, extra[0][1])]
    with pytest.raises(BrokerError, match="conflict"):
        ex.put(extra, timeout=5)
    wrong_size = [({**m, "id": f"{m['id']}x", "group_size": 3}, p) for m, p in group("full")][:1]
    with pytest.raises(BrokerError, match="conflict"):
        ex.put(wrong_size, timeout=5)
    tr = clients(b, "trainer", "tr")
    batch = tr.request(P.FETCH, {"step": 0, "max_groups": 4})
    assert [len(g["trajectories"]) for g in batch.header["groups"]] == [2]


def test_same_id_in_two_puts_of_one_commit_is_stored_once(broker_factory, clients):
    b = broker_factory()
    ex = clients(b, "explorer", "ex", max_in_flight=4)
    futures = [ex.put_async(group("twice")) for _ in range(3)]
    acks = [f.result(10) for f in futures]
    stored = [i for a in acks for i in a["stored"]]
    assert sorted(stored) == ["twice.0", "twice.1"], acks
    assert all(sorted(a["stored"] + a["duplicate"]) == ["twice.0", "twice.1"] for a in acks)


def test_oversized_payload_error_echoes_req(broker_factory, raw_dealer, clients):
    b = broker_factory("broker.max_payload_bytes=1024")
    sock = raw_dealer(b.address)
    hello(sock)
    (meta, _), = group("big", size=1)
    payload = b"\0" * 2000
    sock.send_multipart(P.encode(P.PUT, {"req": 42, "trajectories": [{**meta, "payload_bytes": 2000}]}, [payload]))
    reply = recv(sock)
    assert reply.header["code"] == "too_large" and reply.header["req"] == 42


def test_rehello_under_a_new_name_forgets_the_old_one(broker_factory, raw_dealer, clients):
    b = broker_factory()
    sock = raw_dealer(b.address)
    assert hello(sock, name="first").command == P.WELCOME
    sock.send_multipart(P.encode(P.LEASE, {"req": 2, "max_tasks": 1, "policy_version": 0}))
    assert recv(sock).command == P.TASKS
    assert hello(sock, name="second").command == P.WELCOME
    status = clients(b, "tool", "t").request(P.STATUS).header
    names = {p["name"]: p["leases"] for p in status["peers"]}
    assert "first" not in names and names["second"] == 0
    assert status["tasks"]["leased"] == 0


def test_a_live_name_is_not_taken_over_by_another_connection(broker_factory, raw_dealer, clients):
    b = broker_factory("broker.liveness=50")
    owner = clients(b, "explorer", "ex-1")
    assert owner.request(P.LEASE, {"max_tasks": 1, "policy_version": 0}).command == P.TASKS
    sock = raw_dealer(b.address)
    reply = hello(sock, name="ex-1", session="someone-else")
    assert reply.command == P.ERROR and reply.header["code"] == "conflict" and reply.header["req"] == 1
    status = owner.request(P.STATUS).header
    assert {p["name"]: p["leases"] for p in status["peers"]}["ex-1"] == 1


def test_second_trainer_is_refused_at_once(broker_factory, clients):
    import time

    b = broker_factory()
    clients(b, "trainer", "tr")
    started = time.monotonic()
    with pytest.raises(BrokerError, match="conflict.*one trainer"):
        clients(b, "trainer", "tr-2")
    assert time.monotonic() - started < 5, "the refusal reaches start() without waiting for a timeout"


def test_commit_of_a_step_never_delivered_is_a_conflict(broker_factory, clients):
    b = broker_factory("sync.sync_style=async")
    ex = clients(b, "explorer", "ex")
    tr = clients(b, "trainer", "tr")
    for i in range(3):
        ex.put(group(f"c{i}"), timeout=5)
    tr.request(P.FETCH, {"step": 0, "max_groups": 1})
    tr.request(P.FETCH, {"step": 1, "max_groups": 1})
    # Step 2 EMPTY: nothing delivered for it.
    tr.request(P.COMMIT, {"step": 1})
    assert tr.request(P.COMMIT, {"step": 0}).command == P.OK, "committing again is idempotent"
    with pytest.raises(BrokerError, match="conflict"):
        tr.request(P.COMMIT, {"step": 5})
    assert any(e["event"] == "request_refused" and e["code"] == "conflict" and e["command"] == "COMMIT"
               for e in b.log_events()), "every refusal is logged"


def test_empty_reports_the_groups_it_retired(broker_factory, clients):
    b = broker_factory("sync.sync_style=async", "sync.max_staleness=0")
    ex = clients(b, "explorer", "ex")
    tr = clients(b, "trainer", "tr")
    tr.request(P.FETCH, {"step": 0, "max_groups": 1, "min_groups": 5})
    ex.put(group("stale"), timeout=5)  # version 0
    reply = tr.request(P.FETCH, {"step": 1, "max_groups": 1})
    assert reply.command == P.EMPTY and reply.header["expired"] == 2


def test_put_from_a_trainer_is_refused(broker_factory, clients):
    b = broker_factory()
    tr = clients(b, "trainer", "tr")
    with pytest.raises(BrokerError, match="bad_role"):
        tr.put(group("x"), timeout=5)


def deepest_allowed(levels_above: int):
    """The deepest map a request may carry `levels_above` levels below its header map."""
    return nested(P.MAX_DEPTH - levels_above - 1)


def test_the_deepest_info_a_put_may_carry_comes_back_in_a_batch_the_trainer_reads(broker_factory, clients):
    """The broker re-emits what it stores a few levels deeper than it came (a BATCH puts each trajectory two
    levels further down than its PUT did), so a peer reads replies deeper than the requests it may send."""
    b = broker_factory()
    (meta, payload), = group("deep", size=1)
    info = deepest_allowed(3)  # header, trajectories, the trajectory's map, then info
    assert not P.too_deep({"trajectories": [{**meta, "info": info}]})
    ex = clients(b, "explorer", "ex")
    assert ex.put([({**meta, "info": info}, payload)], timeout=5)["stored"] == ["deep.0"]
    tr = clients(b, "trainer", "tr")
    reply = tr.request(P.FETCH, {"step": 0, "max_groups": 1}, timeout=5)
    assert reply.command == P.BATCH
    assert reply.header["groups"][0]["trajectories"][0]["info"] == info
    deep_tool = clients(b, "tool", "deep-tool", capabilities={"x": deepest_allowed(2)})  # header, capabilities
    peers = clients(b, "tool", "st").request(P.STATUS, timeout=5).header["peers"]
    assert next(p for p in peers if p["name"] == "deep-tool")["capabilities"] == {"x": deepest_allowed(2)}
    deep_tool.close()
    served(b, clients)

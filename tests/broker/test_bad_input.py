"""Every kind of bad frame gets an ERROR reply, and the broker keeps serving everyone else."""

from __future__ import annotations

import pytest

from rlbus.common import protocol as P
from tests.conftest import group, nested, recv


def hello(sock, name="raw"):
    sock.send_multipart(P.encode(P.HELLO, {"role": "explorer", "name": name, "req": 1}))
    assert recv(sock).command == P.WELCOME


def put(req: int, override: dict, payload: bytes = b"x") -> list[bytes]:
    """A PUT of one trajectory whose metadata fields are overridden."""
    meta = {**group("bad")[0][0], "payload_bytes": len(payload), **override}
    return P.encode(P.PUT, {"req": req, "trajectories": [meta]}, [payload])


CASES = {
    "too_few_frames": ([P.PROTOCOL, b"HELLO"], "malformed"),
    "wrong_version": ([b"rlbus/0", b"HELLO", P.pack({})], "bad_version"),
    "not_msgpack": ([P.PROTOCOL, b"STATUS", b"\xc1\xc1\xc1"], "malformed"),
    "header_not_map": ([P.PROTOCOL, b"STATUS", P.pack([1, 2])], "malformed"),
    "binary_key": ([P.PROTOCOL, b"STATUS", P.pack({"req": 13, b"req": 14})], "malformed"),
    "integer_key": ([P.PROTOCOL, b"LEASE", P.pack({"req": 15, 1: 2})], "malformed"),
    "unknown_command": ([P.PROTOCOL, b"EXPLODE", P.pack({"req": 5})], "unknown_command"),
    "wrong_type": ([P.PROTOCOL, b"LEASE", P.pack({"req": 6, "max_tasks": "four", "policy_version": 0})],
                   "bad_field"),
    "missing_field": ([P.PROTOCOL, b"LEASE", P.pack({"req": 7})], "bad_field"),
    "nan_reward": (put(8, {"reward": float("nan")}), "bad_field"),
    "negative_version": (put(11, {"policy_version": -1}), "bad_field"),
    "payload_size_mismatch": (put(9, {"payload_bytes": 999}), "bad_field"),
    "no_payload_frame": (P.encode(P.PUT, {"req": 12, "trajectories": []}), "bad_field"),
    "oversized_message": (put(10, {}, b"\0" * (1 << 17)), "too_large"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_frame_gets_error_and_broker_goes_on(broker_factory, raw_dealer, clients, case):
    b = broker_factory("broker.max_message_bytes=65536")
    sock = raw_dealer(b.address)
    hello(sock)
    frames, code = CASES[case]
    sock.send_multipart(frames)
    reply = recv(sock)
    assert reply.command == P.ERROR and reply.header["code"] == code, reply.header
    assert reply.header["message"]
    # The same broker still serves a well-behaved peer, and the bad one too.
    good = clients(b, "explorer", "good")
    assert good.put(group("ok"), timeout=5)["stored"] == ["ok.0", "ok.1"]
    sock.send_multipart(P.encode(P.STATUS, {"req": 99}))
    assert recv(sock).header["req"] == 99
    assert any(e["event"] == "bad_message" and e["code"] == code for e in b.log_events())


def test_a_refused_header_has_its_req_echoed_whenever_it_can_be_read(broker, raw_dealer):
    """An ERROR carries the request's `req` wherever the header can be read: a header over the 1 MiB limit
    and one nested too deep are refused unbuilt, yet their `req` (a top-level key) is found and echoed; so is
    that of a request under another protocol tag."""
    sock = raw_dealer(broker.address)
    hello(sock)
    for req, header, code, tag in ((21, {"pad": "x" * (P.MAX_HEADER_BYTES + 1), "req": 21}, "too_large", P.PROTOCOL),
                                   (22, {"deep": nested(P.MAX_DEPTH + 4), "req": 22}, "malformed", P.PROTOCOL),
                                   (23, {"req": 23}, "bad_version", b"rlbus/2")):
        sock.send_multipart([tag, b"STATUS", P.pack(header)])
        reply = recv(sock)
        assert (reply.command, reply.header["code"], reply.header.get("req")) == (P.ERROR, code, req), reply.header


def test_request_before_hello_is_refused(broker, raw_dealer):
    sock = raw_dealer(broker.address)
    sock.send_multipart(P.encode(P.LEASE, {"req": 1, "max_tasks": 1, "policy_version": 0}))
    reply = recv(sock)
    assert reply.header["code"] == "not_registered" and reply.header["req"] == 1


def test_bad_role_in_hello(broker, raw_dealer):
    sock = raw_dealer(broker.address)
    sock.send_multipart(P.encode(P.HELLO, {"role": "emperor", "name": "x", "req": 1}))
    reply = recv(sock)
    assert reply.header["code"] == "bad_field" and "role" in reply.header["message"]

"""Every request to the weight server gets its reply, however many a client keeps in flight; a client that does
not read holds a bounded amount (weights/replies.py). Real sockets on loopback."""

from __future__ import annotations

import time

import pytest
import zmq

from rlbus.common import protocol as P
from rlbus.weights import replies as R
from rlbus.weights.server import CHUNK, ERROR, MAGIC, MANIFEST


@pytest.mark.parametrize("in_flight", [64, 512])
def test_a_client_with_many_requests_in_flight_gets_every_reply(served, dealer, in_flight):
    # CHUNKs that name no file: small ERRORs, answered at once, as fast as the server reads the requests. A
    # ROUTER that drops at its high-water mark lost 17 of 64 and 154 of 256 so, the client reading all along.
    for req in range(in_flight):
        dealer.send_multipart([MAGIC, CHUNK, P.pack({"req": req, "version": 1})])
    got = []
    while len(got) < in_flight and dealer.poll(10_000):
        command, header = dealer.recv_multipart()[1:3]
        assert command == ERROR
        got.append(P.unpack(header)["req"])
    assert sorted(got) == list(range(in_flight))
    assert served[0].out.dropped == 0
    # Then manifests too, interleaved with what is still answered at once.
    for req in range(32):
        dealer.send_multipart([MAGIC, MANIFEST if req % 2 else CHUNK, P.pack({"req": req, "version": 2})])
    answers = {}
    while len(answers) < 32 and dealer.poll(10_000):
        command, header = dealer.recv_multipart()[1:3]
        answers[P.unpack(header)["req"]] = command
    assert answers == {req: MANIFEST if req % 2 else ERROR for req in range(32)}


@pytest.fixture
def pair():
    """A ROUTER with its `Replies` (16 replies queued per client, as the server's) and a DEALER that takes one
    reply into its own queue at a time, so that what it does not read backs up to the ROUTER."""
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.sndhwm, router.linger, dealer.rcvhwm, dealer.linger = 16, 0, 1, 0
    dealer.rcvbuf = router.sndbuf = 64 << 10
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"hello")
    ident, _ = router.recv_multipart()
    yield R.Replies(router), router, dealer, ident
    router.close(0)
    dealer.close(0)
    ctx.term()


def test_a_client_that_does_not_read_holds_a_bounded_amount_then_gets_what_was_held_in_order(pair, monkeypatch):
    monkeypatch.setattr(R, "MAX_HELD_BYTES", 8 << 20)
    out, router, dealer, ident = pair
    block = bytes(1 << 20)
    for i in range(64):  # 64 MB for a client that reads nothing meanwhile
        out.send(ident, [i.to_bytes(4, "big"), block])
        out.flush()
    assert out.pending
    assert 0 < out.dropped < 64 - 8  # what ZeroMQ's queues took and 8 held got through; the rest dropped
    got = []
    deadline = time.monotonic() + 30
    while (out.pending or dealer.poll(500)) and time.monotonic() < deadline:
        while dealer.poll(0):
            got.append(int.from_bytes(dealer.recv_multipart()[0], "big"))
        router.poll(10, zmq.POLLOUT)  # lets the socket take note of what the client read
        out.flush()
    assert not out.pending
    assert len(got) == 64 - out.dropped
    assert got == list(range(len(got)))  # in order, and nothing missing before the first drop


def test_replies_to_a_client_that_is_gone_are_dropped_without_error(pair):
    out, router, dealer, _ = pair
    out.send(b"\x00gone", [b"reply"])
    out.flush()
    assert not out.pending

"""Property-based fuzzing of a real weight server: every message gets exactly one reply, also when sent in bursts.

Hypothesis draws batches of messages (MANIFEST, CHUNK and unknown commands; headers whose fields are of any
type and size; a wrong magic, missing or extra frames) and sends each batch at once from one DEALER, then reads
the replies: as many as messages; each request whose `req` can be read (an unsigned integer in a well-formed
message) answered under it; no `internal` error; and the server still serves a whole manifest after.
"""

from __future__ import annotations

import pytest
import zmq

hypothesis = pytest.importorskip("hypothesis")
pytest.importorskip("zstandard")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from rlbus.common import protocol as P  # noqa: E402
from rlbus.weights.server import CHUNK, ERROR, MAGIC, MANIFEST, WeightServer  # noqa: E402

FIELDS = ["req", "version", "base", "base_digest", "file", "index", "delta_wait_ms", "junk"]
TEXT = st.text(max_size=8) | st.sampled_from(["config.json", "model.safetensors", "../config.json", "/etc/passwd"])
SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
           | st.integers(0, 4) | st.floats(allow_nan=True) | TEXT | st.binary(max_size=8))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(FIELDS) | TEXT, inner, max_size=3), max_leaves=8)
REQ = 1 << 53  # requests at most 2^53 - 1


@st.composite
def messages(draw) -> tuple[list[bytes], int | None]:
    """(frames, the req its reply must carry, or None where it need not be readable)."""
    header = draw(st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=7))
    if draw(st.booleans()):
        header["version"] = draw(st.integers(0, 4))
    if draw(st.booleans()):
        header["req"] = draw(st.integers(0, REQ - 1))
    command = draw(st.sampled_from([MANIFEST, CHUNK, CHUNK, b"PING", b""]))
    frames = [draw(st.sampled_from([MAGIC] * 8 + [b"rlbus-weights/2", b""])), command, P.pack(header)]
    shape = draw(st.sampled_from(["ok"] * 6 + ["short", "long"]))
    frames = frames[:2] if shape == "short" else frames + [b"extra"] if shape == "long" else frames
    req = header.get("req")
    readable = shape == "ok" and frames[0] == MAGIC and type(req) is int and 0 <= req < REQ
    return frames, req if readable else None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.helpers.served import CHUNK_BYTES, publish_versions

    root = tmp_path_factory.mktemp("fuzzed") / "served"
    publish_versions(root, 3)
    server = WeightServer(root, chunk_bytes=CHUNK_BYTES).start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(server.address)
    yield server, sock
    sock.close(0)
    server.close()


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(batch=st.lists(messages(), min_size=1, max_size=80))
def test_every_message_gets_exactly_one_reply(server, batch):
    server, sock = server
    for frames, _ in batch:
        sock.send_multipart(frames)
    replies = []
    while len(replies) < len(batch) and sock.poll(15_000):
        replies.append(sock.recv_multipart())
    assert len(replies) == len(batch), f"{len(batch) - len(replies)} of {len(batch)} messages got no reply"
    assert not sock.poll(50), "a message got two replies"
    headers = [P.unpack(r[2]) for r in replies]
    assert all(r[0] == MAGIC and r[1] in (MANIFEST, CHUNK, ERROR) for r in replies)
    assert not [h for r, h in zip(replies, headers) if r[1] == ERROR and h["code"] == "internal"]
    answered = sorted(h["req"] for h in headers if "req" in h)
    for req in (req for _, req in batch if req is not None):
        assert req in answered, f"request {req} was not answered under its req"
    sock.send_multipart([MAGIC, MANIFEST, P.pack({"req": 7, "version": 3})])
    assert sock.poll(15_000)
    command, header = sock.recv_multipart()[1:3]
    assert command == MANIFEST and P.unpack(header)["req"] == 7

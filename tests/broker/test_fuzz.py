"""Property-based fuzzing of a real broker: hostile frames never stop it or cost acknowledged data.

Hypothesis draws a few hundred messages (known and unknown commands, headers
whose fields are of any type, depth and size, stray payload frames) and sends
them from a raw socket, interleaved with a well-behaved explorer's PUTs. After
every message the broker process is alive and answers another peer; at the
end a trainer fetches every complete group, and each trajectory the broker
ACKed to the good explorer is delivered exactly once.
"""

from __future__ import annotations

import pytest
import zmq

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from rlbus.common import messages as M, protocol as P  # noqa: E402
from tests.conftest import group  # noqa: E402

FIELDS = sorted({f for struct in (*M.HEADERS.values(), M.Trajectory, M.Broadcast, M.Rollout, M.Capabilities)
                 for f in M.fields(struct)} | {"junk"})
# "§" never appears in fuzzed text, so fuzzed PUTs cannot join the good explorer's groups.
TEXT = st.text(alphabet=st.characters(blacklist_characters="§", blacklist_categories=("Cs",)), max_size=12)
SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(1 << 64), max_value=(1 << 64) - 1)
           | st.floats(allow_nan=True, allow_infinity=True) | TEXT | st.binary(max_size=16)
           | st.sampled_from(["t1.0", "t\u00b2.0", "explorer", "trainer", "reward", "checkpoint", "nccl"]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.sampled_from(FIELDS) | TEXT, inner, max_size=4), max_leaves=12)


def deep(depth: int):
    value = 1
    for _ in range(depth):
        value = {"a": value}
    return value


HEADERS = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=8),
    st.builds(lambda d: {"req": 1, "info": deep(d), "capabilities": deep(d)}, st.integers(1, 1100)),
)
COMMANDS = st.sampled_from(sorted(M.HEADERS) + ["WELCOME", "EXPLODE", "hello", "PUT "])


@st.composite
def messages(draw) -> list[bytes]:
    command = draw(COMMANDS)
    header = draw(HEADERS)
    if command == "HELLO" and header.get("role") == "trainer":
        header["role"] = "tool"  # a fuzzing trainer could take batches; everything else may be hostile
    if command == "PUT" and draw(st.booleans()):
        meta, payload = group(draw(TEXT), size=draw(st.integers(1, 3)))[0]
        meta.update({k: v for k, v in header.items() if k in M.fields(M.Trajectory) and draw(st.booleans())})
        header = {"req": 1, "trajectories": [meta]}
        payloads = [payload[:draw(st.integers(0, len(payload)))]]
        if draw(st.booleans()):
            meta["payload_bytes"] = len(payloads[0])
    else:
        payloads = draw(st.lists(st.binary(max_size=32), max_size=2))
    head = draw(st.sampled_from([P.PROTOCOL] * 8 + [b"rlbus/2", b""]))
    try:
        packed = P.pack(header)
    except (ValueError, OverflowError, TypeError):
        packed = b"\xc1"
    return [head, command.encode("utf-8"), packed, *payloads]


class Run:
    """One broker for every example, with the well-behaved peers that check it between messages."""

    def __init__(self, data_dir):
        from rlbus.common.client import BrokerClient
        from tests.conftest import BrokerProcess

        self.broker = BrokerProcess(data_dir, ["sync.sync_style=async", "sync.max_staleness=1000000",
                                               "broker.max_message_bytes=65536"]).start()
        self.peers = []

        def peer(role: str, name: str) -> BrokerClient:
            c = BrokerClient(self.broker.address, role, name, heartbeat_interval_s=0.2, backoff_max_s=0.5)
            c.start(10)
            self.peers.append(c)
            return c

        self.good, self.probe, self.trainer = peer("explorer", "good§explorer"), peer("tool", "probe§"), peer(
            "trainer", "checker§")
        self.fuzz = zmq.Context.instance().socket(zmq.DEALER)
        self.fuzz.setsockopt(zmq.LINGER, 0)
        self.fuzz.connect(self.broker.address)
        self.acked: set[str] = set()
        self.delivered: list[str] = []
        self.step = 0
        self.sent = self.answered = 0

    def close(self) -> None:
        for c in self.peers:
            c.close(bye=False, timeout=1)
        self.fuzz.close(0)
        self.broker.kill()


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=st.lists(messages(), min_size=1, max_size=30))
def fuzz(run: Run, batch: list[list[bytes]]) -> None:
    for frames in batch:
        run.fuzz.send_multipart(frames)
        run.sent += 1
        if run.sent % 10 == 0:
            run.acked.update(run.good.put(group(f"good§{run.sent}", size=2), timeout=10)["stored"])
        assert run.probe.request(P.STATUS, timeout=10).command == P.STATUS, f"no answer after {frames[:2]}"
        assert run.broker.proc.poll() is None, f"the broker died on {frames[:2]}"
        while run.fuzz.poll(0):  # drain replies; the fuzzing socket may get any answer
            run.fuzz.recv_multipart(zmq.NOBLOCK)
            run.answered += 1
    while True:  # the trainer takes every complete group there is
        reply = run.trainer.request(P.FETCH, {"step": run.step, "max_groups": 64}, timeout=10)
        if reply.command == P.EMPTY:
            break
        run.delivered += [t["id"] for g in reply.header["groups"] for t in g["trajectories"]]
        run.trainer.request(P.COMMIT, {"step": run.step}, timeout=10)
        run.step += 1
    good = [i for i in run.delivered if i.startswith("good§")]
    assert len(good) == len(set(good)), "an ACKed trajectory was delivered twice"
    assert set(good) == run.acked, "an ACKed trajectory was not delivered"


def test_fuzzed_messages_never_stop_the_broker_or_lose_acked_data(tmp_path):
    run = Run(tmp_path)
    try:
        fuzz(run)
        # The fuzzer reached the broker: most fuzzed messages were answered, and ACKed data was checked.
        assert run.sent >= 150 and run.answered > run.sent // 3 and len(run.acked) >= 20, \
            (run.sent, run.answered, len(run.acked))
    finally:
        run.close()

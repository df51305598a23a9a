"""Frame encoding and validation, and the trajectory payload codec."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, strategies as st

from rlbus.common import messages as M, protocol as P
from rlbus.common.trajectory import decode_payload, encode_payload
from tests.conftest import nested
from tests.helpers.announce import broadcast_publish


def test_roundtrip_keeps_command_header_and_payloads():
    frames = P.encode(P.PUT, {"req": 3, "x": [1, 2]}, [b"a", b"bc"])
    msg = P.decode(frames)
    assert (msg.command, msg.header, msg.payloads) == ("PUT", {"req": 3, "x": [1, 2]}, [b"a", b"bc"])


def test_join_and_split_payloads():
    metas = [{"id": "a"}, {"id": "b"}]
    frame = P.join_payloads(metas, [b"xx", b"yyy"])
    assert [m["payload_bytes"] for m in metas] == [2, 3]
    assert [bytes(v) for v in P.split_payloads(metas, frame)] == [b"xx", b"yyy"]
    assert [bytes(v) for v in P.split_payloads(metas, [b"x", b"xyy", b"y"])] == [b"xx", b"yyy"]
    with pytest.raises(P.ProtocolError):
        P.split_payloads(metas, b"too long")


@given(st.lists(st.binary(max_size=12), max_size=8), st.data())
def test_payloads_split_from_frames_cut_anywhere_are_the_payloads_and_whole_frames_are_not_copied(payloads, data):
    metas = [{"id": str(i)} for i in range(len(payloads))]
    joined = P.join_payloads(metas, payloads)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(joined)), max_size=4)))
    frames = [joined[a:b] for a, b in zip([0, *cuts], [*cuts, len(joined)])]
    assert [bytes(v) for v in P.split_payloads(metas, frames)] == payloads
    whole = [bytes(p) for p in payloads]  # one frame a payload: every payload a view of its frame
    assert all(v.obj is w for v, w in zip(P.split_payloads(metas, whole), whole, strict=True) if w)


@pytest.mark.parametrize("header,field", [
    ({"max_tasks": True, "policy_version": 0}, "max_tasks"),  # bool is not an int here
    ({"max_tasks": -1, "policy_version": 0}, "max_tasks"),
    ({"max_tasks": 1}, "policy_version"),
])
def test_validate_names_the_bad_field(header, field):
    with pytest.raises(P.ProtocolError) as err:
        P.validate(P.Message(P.LEASE, header))
    assert err.value.code == "bad_field" and field in err.value.message


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), float("-inf")])
def test_a_reward_that_is_not_finite_is_named_as_such(reward):
    header = {"trajectories": [{**_meta(0), "payload_bytes": 4, "reward": reward}]}
    with pytest.raises(P.ProtocolError) as err:
        P.validate(P.Message(P.PUT, header, [b"x" * 4]))
    assert err.value.code == "bad_field"
    assert "Expected a finite `float` - at `$.trajectories[0].reward`" in err.value.message, err.value.message


@pytest.mark.parametrize("field", ["id", "group_id", "task_id"])
def test_an_empty_trajectory_id_is_a_bad_field(field):
    header = {"trajectories": [{**_meta(0), "payload_bytes": 4, field: ""}]}
    with pytest.raises(P.ProtocolError) as err:
        P.validate(P.Message(P.PUT, header, [b"x" * 4]))
    assert err.value.code == "bad_field" and f"$.trajectories[0].{field}" in err.value.message, err.value.message


def test_an_empty_peer_name_is_a_bad_field():
    with pytest.raises(P.ProtocolError) as err:
        P.validate(P.Message(P.HELLO, {"role": "explorer", "name": ""}))
    assert err.value.code == "bad_field" and "name" in err.value.message


@pytest.mark.parametrize("workers", [0, M.MAX_WORKERS + 1])
def test_broadcast_workers_outside_1_to_the_maximum_is_a_bad_field(workers):
    with pytest.raises(P.ProtocolError) as err:
        P.validate(P.Message(P.HELLO, {"role": "explorer", "name": "x",
                                       "capabilities": {"broadcast_workers": workers}}))
    assert err.value.code == "bad_field" and "$.capabilities.broadcast_workers" in err.value.message


@pytest.mark.parametrize("world,ranks,workers", [
    (3, {"a": 1, "b": 2}, None),
    (4, {"a": 1, "tp": 2}, {"tp": 2}),
    (5, {"tp": 1, "a": 4}, {"tp": 3, "a": 1}),
    (1, {}, None),  # no member: nothing to check
])
def test_a_broadcast_whose_members_ranks_fit_the_world_is_valid(world, ranks, workers):
    P.validate(broadcast_publish(world, ranks, workers))


@pytest.mark.parametrize("world,ranks,workers,named", [
    (2, {"a": 0}, None, "'a' takes rank 0"),  # rank 0 is the trainer's
    (2, {"a": 2}, None, "'a' takes rank 2"),
    (3, {"a": 1, "b": 1}, None, "takes rank 1"),  # one rank, two members
    (3, {"a": 1, "tp": 2}, {"tp": 2}, "'tp' takes ranks 2..3"),  # its second worker is outside the world
    (4, {"tp": 1, "a": 2}, {"tp": 2}, "'tp' takes ranks 1..2"),  # its second worker's rank is a's
    (3, {"a": 1}, {"b": 1}, "workers names ['b']"),
])
def test_a_broadcast_whose_ranks_do_not_fit_the_world_or_overlap_is_a_bad_field(world, ranks, workers, named):
    with pytest.raises(P.ProtocolError) as err:
        P.validate(broadcast_publish(world, ranks, workers))
    assert err.value.code == "bad_field" and named in err.value.message, err.value.message


def test_a_broadcast_announcing_another_version_than_its_publish_is_a_bad_field():
    publish = broadcast_publish(2, {"a": 1})
    publish.header["broadcast"]["version"] = 5
    with pytest.raises(P.ProtocolError) as err:
        P.validate(publish)
    assert err.value.code == "bad_field" and "version 5 is not the version published (1)" in err.value.message


def test_decode_rejects_oversized_messages_before_parsing():
    with pytest.raises(P.ProtocolError) as err:
        P.decode(P.encode(P.STATUS, {}, [b"\0" * 1000]), max_message_bytes=500)
    assert err.value.code == "too_large"


@pytest.mark.parametrize("header", [b"\xc1", b"\x92", b"\x81\xa1a", b"\x01\x02"])
def test_a_header_that_is_not_msgpack_is_malformed_and_the_message_says_why(header):
    with pytest.raises(P.ProtocolError) as err:
        P.decode([P.PROTOCOL, b"STATUS", header])
    assert err.value.code == "malformed"
    reason = err.value.message.removeprefix("header is not valid msgpack: ")
    assert reason != err.value.message and reason.strip(), err.value.message  # says what msgpack found


@pytest.mark.parametrize("header, named", [
    (P.pack({1: "x", "req": 3}), "one is int"),  # valid msgpack, which the protocol's string keys rule out
    (P.pack({"req": 3, b"req": 4}), "one is bytes b'req'"),
    (P.pack({"status": {2.5: 1}}), "one is float"),  # a key of a map inside it, neither a string nor binary
    (P.pack({"status": {None: 1}}), "one is NoneType"),
])
def test_a_header_key_that_is_not_a_string_is_malformed_and_named(header, named):
    with pytest.raises(P.ProtocolError) as err:
        P.decode([P.PROTOCOL, b"STATUS", header])
    assert (err.value.code, err.value.message) == ("malformed", f"map keys in a header are strings; {named}")


def test_a_binary_key_inside_a_field_is_that_fields_error():
    header = {"trajectories": [_meta(0, payload_bytes=10, info={b"k": 1})]}
    put = P.decode([P.PROTOCOL, b"PUT", P.pack(header), b"\0" * 10])
    with pytest.raises(P.ProtocolError) as err:
        P.validate(put)
    assert err.value.code == "bad_field" and "$.trajectories[0].info" in err.value.message


@pytest.mark.parametrize("header, req", [
    (P.pack({"req": 7, "x": 1}), 7),
    (P.pack({"x": nested(P.MAX_DEPTH + 4), "req": 8}), 8),  # read past a value too deep to accept
    (P.pack({"pad": "x" * (2 << 20), "req": 9}), 9),  # past a header over the limit
    (P.pack({"req": True}), None), (P.pack({"req": -1}), None), (P.pack({"req": 1 << 53}), None),
    (P.pack({"req": "1"}), None), (P.pack({"x": 1}), None), (P.pack([1, 2]), None), (b"\xc1", None),
    (P.pack({"x": 1, "req": 3})[:-1], None),  # cut short before its req
])
def test_the_req_of_a_refused_header_is_read_wherever_it_can_be(header, req):
    assert P.request_id(header) == req


def test_trajectory_payload_roundtrip_without_pickle():
    ids = np.arange(7, dtype=np.int32)
    logp = -np.linspace(0, 1, 7, dtype=np.float32)
    frame = encode_payload({"response_ids": ids, "logprobs": logp}, {"finish_reason": "stop"})
    assert b"pickle" not in frame and frame[:1] != b"\x80"
    body = decode_payload(frame)
    assert body["finish_reason"] == "stop"
    np.testing.assert_array_equal(body["response_ids"], ids)
    np.testing.assert_array_equal(body["logprobs"], logp)


def test_payload_with_wrong_length_is_refused():
    frame = P.pack({"v": 1, "a": {"dtype": "int32", "shape": [3], "data": b"\0" * 8}})
    with pytest.raises(ValueError, match="does not match"):
        decode_payload(frame)


def test_trajectory_headers_are_not_tracked_by_the_cyclic_collector():
    # The broker validates 64 of them per PUT; tracked, they would run the collector every few trajectories.
    import gc

    from rlbus.common.messages import Trajectory, check

    put = check("PUT", {"trajectories": [{"id": "a", "group_id": "g", "task_id": "t", "group_size": 1,
                                          "batch_index": 0, "policy_version": 0, "reward": 1.0, "n_tokens": 1,
                                          "payload_bytes": 4, "info": {"k": [1]}}]})
    assert isinstance(put.trajectories[0], Trajectory)
    assert not gc.is_tracked(put.trajectories[0])


def test_pack_writes_the_bytes_msgpack_writes():
    """Peers and stored catalogues read what `pack` writes with any msgpack library: the encoding (smallest
    int and str forms, bin for bytes, float64) must stay msgpack's own byte for byte."""
    values = [{}, [], "", 0, -1, 127, 128, -33, 2**32, 2**64 - 1, -(2**63), 1.5, float("inf"), True, False, None,
              b"\x00\xff", bytearray(b"ab"), memoryview(b"xy"), "é" * 40, "x" * 70_000, (1, "t"),
              {"trajectories": [{"id": "g.0", "reward": 1.0, "info": {"k": [1, {"d": None}]}}], "req": 5}]
    for value in values:
        assert P.pack(value) == msgpack.packb(value, use_bin_type=True), value
        assert P.unpack(P.pack(value)) == msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False)
    for bad in (2**64, object()):
        with pytest.raises((TypeError, OverflowError)):
            P.pack(bad)


def _put(trajectories: list[dict]) -> list[bytes]:
    frame = P.join_payloads(trajectories, [b"x" * (i + 1) for i in range(len(trajectories))])
    return P.encode(P.PUT, {"req": 9, "trajectories": trajectories}, [frame])


def _meta(i: int = 0, **extra) -> dict:
    return {"id": f"g.{i}", "group_id": "g", "task_id": "t", "group_size": 2, "batch_index": 0,
            "policy_version": 1, "reward": 0.5, "n_tokens": 3, **extra}


def _answer(frames: list[bytes]) -> tuple[str, str] | dict:
    """What the broker makes of a PUT: its header, or the error (code, message)."""
    try:
        msg = P.decode(frames)
        P.validate(msg)
    except P.ProtocolError as exc:
        return exc.code, exc.message
    return msg.header


def _general(frames: list[bytes], monkeypatch) -> tuple[str, str] | dict:
    """The answer of the general path alone (msgpack, depth check, validation)."""
    with monkeypatch.context() as m:
        m.setattr(P, "_plain_put", lambda header: None)
        return _answer(frames)


@pytest.mark.parametrize("trajectories", [
    [_meta(0), _meta(1, info={"finish_reason": "stop", "k": 2})],
    [_meta(0, last_version=3, info={})],
    [_meta(0, reward=1)],  # an int where a float belongs: taken as the float
])
def test_a_plain_put_is_decoded_in_one_pass_to_what_the_general_path_makes(trajectories, monkeypatch):
    frames = _put(trajectories)
    msg = P.decode(frames)
    assert isinstance(msg.typed, M.PlainPut)
    assert P.validate(msg) is msg.typed
    assert msg.header == _general(frames, monkeypatch)


@pytest.mark.parametrize("trajectories, answer", [
    ([_meta(0, extra_field=[1, {"a": 2}])], "kept"),          # a field the protocol does not name is kept
    ([_meta(0, info={"nested": {"a": [1, 2]}})], "kept"),    # an info that is not all scalars
    ([_meta(0, info={"a": None})], "kept"),
    ([_meta(0, reward=None)], "bad_field"),
    ([_meta(0, reward=float("nan"))], "bad_field"),
    ([_meta(0, group_size=0)], "bad_field"),
    ([_meta(0, id="x" * 129)], "bad_field"),
    ([_meta(0, info={"a": [[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]})], "malformed"),
])
def test_a_put_the_one_pass_decoder_does_not_fit_gets_the_general_paths_answer(trajectories, answer, monkeypatch):
    frames = _put(trajectories)
    assert P._plain_put(frames[2]) is None
    got = _answer(frames)
    assert got == _general(frames, monkeypatch)
    assert (answer == "kept") == isinstance(got, dict)
    if answer != "kept":
        assert got[0] == answer


def test_a_reply_may_be_larger_and_deeper_than_a_request():
    """The broker re-emits what it stored below where it came (BATCH: two levels), and a BATCH of many groups
    outgrows a request's header limit: a peer and the trainer's other ranks read it with the reply limits."""
    from rlbus.trainer.distributed import Plan

    info = {"a": 1}
    for _ in range(P.MAX_DEPTH - 5):
        info = {"a": info}
    metas = [{"id": f"g.{i}", "pad": "x" * 200, "info": info} for i in range(6000)]
    frames = P.encode(P.BATCH, {"step": 1, "groups": [{"group_id": "g", "trajectories": metas}]}, [b"p"])
    assert len(frames[2]) > P.MAX_HEADER_BYTES and P.too_deep(P.unpack(frames[2]))
    with pytest.raises(P.ProtocolError):
        P.decode(frames)
    assert P.decode_reply(frames).header["groups"][0]["trajectories"][5999]["info"] == info
    assert Plan("train", 1, frames=frames).reply().header["step"] == 1

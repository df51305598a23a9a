"""Decoding a BATCH: trajectories that cannot be trained on are counted by reason and left out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlbus.common import protocol as P
from rlbus.common.trajectory import encode_payload
from rlbus.trainer.batch import Sample, build_batch, decode_batch


def trajectory(tid: str, sampling: dict | None) -> tuple[dict, bytes]:
    extra = {"sampling": sampling} if sampling is not None else {}
    payload = encode_payload({"prompt_ids": np.array([1, 2], dtype=np.int32),
                              "response_ids": np.array([3, 4], dtype=np.int32),
                              "logprobs": np.array([-1.0, -0.5], dtype=np.float32),
                              "loss_mask": np.ones(2, dtype=np.uint8)}, extra)
    return {"id": tid, "group_id": "g", "task_id": "t", "group_size": 3, "batch_index": 0, "policy_version": 0,
            "reward": 1.0, "n_tokens": 2}, payload


def test_a_trajectory_sampled_at_another_temperature_is_left_out():
    items = [trajectory("a", {"temperature": 0.7, "top_p": 1.0}), trajectory("b", {"temperature": 1.0, "top_p": 1.0}),
             trajectory("c", None)]  # a producer that does not say: trusted, as before
    metas = [m for m, _ in items]
    frame = P.join_payloads(metas, [p for _, p in items])
    reply = P.Message(P.BATCH, {"groups": [{"group_id": "g", "batch_index": 0, "trajectories": metas}]}, [frame])
    samples, rejected = decode_batch(reply, vocab_size=10, temperature=0.7)
    assert [s.id for s in samples] == ["a", "c"]
    assert list(rejected.values()) == [1] and "temperature 1.0" in next(iter(rejected))
    samples, rejected = decode_batch(reply, vocab_size=10)  # no temperature to check against
    assert len(samples) == 3 and not rejected


def test_metadata_that_breaks_the_trajectory_type_is_left_out_not_fatal():
    items = [trajectory("a", None), trajectory("b", None)]
    items[1][0]["reward"] = float("nan")
    metas = [m for m, _ in items]
    frame = P.join_payloads(metas, [p for _, p in items])
    reply = P.Message(P.BATCH, {"groups": [{"group_id": "g", "batch_index": 0, "trajectories": metas}]}, [frame])
    samples, rejected = decode_batch(reply, vocab_size=10)
    assert [s.id for s in samples] == ["a"] and "reward" in next(iter(rejected))


def batch_of(*payloads: bytes) -> P.Message:
    metas = [trajectory(f"t{i}", None)[0] for i in range(len(payloads))]
    frame = P.join_payloads(metas, list(payloads))
    return P.Message(P.BATCH, {"groups": [{"group_id": "g", "batch_index": 0, "trajectories": metas}]}, [frame])


@pytest.mark.parametrize("change,reason", [
    ({"prompt_ids": np.ones((2, 2), np.int32)}, "prompt_ids is not a one-dimensional array"),
    ({"response_ids": 7}, "response_ids is not a one-dimensional array"),
    ({"logprobs": [-1.0, -0.5]}, "logprobs is not a one-dimensional array"),
    ({"prompt_ids": np.array([1.5, 2.0])}, "prompt_ids are float64, not integers"),
    ({"response_ids": np.array([True, False])}, "response_ids are bool, not integers"),
    ({"logprobs": np.array([-1, 0], np.int32)}, "logprobs are int32, not floats"),
    ({"loss_mask": np.array([1, 7], np.uint8)}, "loss_mask holds values other than 0 and 1"),
    ({"loss_mask": np.array([0.5, 1.0], np.float32)}, "loss_mask holds values other than 0 and 1"),
    ({"loss_mask": None}, "loss_mask is not a one-dimensional array"),
])
def test_a_payload_of_the_wrong_shape_or_kind_is_left_out_with_its_reason(change, reason):
    """Whatever an explorer's payload holds, the trainer leaves that trajectory out and trains on the rest: it
    never raises, and never weighs a token by a mask value other than 0 or 1."""
    arrays = {"prompt_ids": np.array([1, 2], np.int32), "response_ids": np.array([3, 4], np.int32),
              "logprobs": np.array([-1.0, -0.5], np.float32), "loss_mask": np.ones(2, np.uint8)}
    good = encode_payload(arrays)
    bad_arrays = {k: v for k, v in {**arrays, **change}.items() if isinstance(v, np.ndarray)}
    bad = encode_payload(bad_arrays, {k: v for k, v in change.items() if not isinstance(v, np.ndarray)})
    samples, rejected = decode_batch(batch_of(good, bad, good), vocab_size=10)
    assert [s.id for s in samples] == ["t0", "t2"]
    assert rejected == {reason: 1}


def test_a_mask_of_booleans_or_of_float_zeros_and_ones_trains_as_one_of_integers():
    base = {"prompt_ids": np.array([1, 2], np.int32), "response_ids": np.array([3, 4], np.int32),
            "logprobs": np.array([-1.0, -0.5], np.float32)}
    payloads = [encode_payload({**base, "loss_mask": mask}) for mask in
                (np.array([1, 0], np.uint8), np.array([True, False]), np.array([1.0, 0.0], np.float32))]
    samples, rejected = decode_batch(batch_of(*payloads), vocab_size=10)
    assert not rejected
    masks = build_batch(samples, rejected, "grpo", False, 0).loss_mask
    assert torch.equal(masks[0], masks[1]) and torch.equal(masks[0], masks[2]) and masks[0].sum() == 1


def test_a_check_that_fails_on_a_payload_leaves_out_that_trajectory_only(monkeypatch):
    import rlbus.trainer.batch as batch

    real = batch.check

    def failing(body, vocab_size):
        if body.get("boom"):
            raise RuntimeError("unforeseen")
        return real(body, vocab_size)

    monkeypatch.setattr(batch, "check", failing)
    good, bad = trajectory("a", None)[1], encode_payload({}, {"boom": True})
    samples, rejected = decode_batch(batch_of(good, bad), vocab_size=10)
    assert [s.id for s in samples] == ["t0"] and rejected == {"payload not usable: unforeseen": 1}


def test_reinforce_pp_weighs_each_sample_by_the_response_tokens_its_loss_mask_keeps():
    def sample(i: int, reward: float, mask: list[int]) -> Sample:
        n = len(mask)
        return Sample(f"s{i}", i, reward, 0, 0, np.array([1, 2]), np.full(n, 3), np.full(n, -1.0, dtype=np.float32),
                      np.array(mask, dtype=np.uint8))
    # Four response tokens each, but the loss keeps three of the first sample's and one of the second's:
    # over those four tokens the rewards are 1, 1, 1, 0 (mean 0.75, std 0.5).
    batch = build_batch([sample(0, 1.0, [1, 1, 0, 1]), sample(1, 0.0, [0, 0, 1, 0])], {}, "reinforce_pp", False, 0)
    assert np.allclose(batch.advantages.numpy(), [0.5, -1.5], atol=1e-5)

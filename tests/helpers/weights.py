"""Comparing weights that two paths trained on the same batches, up to the order of their floating-point sums."""

from __future__ import annotations


def assert_same_weights(got: dict, want: dict, lr: float) -> None:
    """Every element within a tenth of one Adam step, and the mean element within 1e-7.

    Adam divides each element's gradient by that element's own running size, so an element whose gradient is near
    zero (the embedding row of a token that only the softmax's tail reaches) turns a difference in the last bits of
    its gradient sum into a visible part of one step; how large depends on the CPU's vector width (after three
    steps at lr 1e-3, 1.2e-6 on one machine and 1.6e-5 on another). A wrong shard, a missing reduction or a leaking
    mask moves many elements by whole steps."""
    assert got.keys() == want.keys()
    for k in want:
        diff = (got[k] - want[k]).abs()
        assert diff.max() <= 0.1 * lr and diff.mean() <= 1e-7, (k, diff.max(), diff.mean())

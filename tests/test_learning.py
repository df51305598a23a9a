"""The tiny model learns in CI: a real run (`rlbus up`), synchronous and fully asynchronous, raises its reward.

The reward (tests/helpers/first_token.py) pays for a first response token in
the lower half of the vocabulary; responses are one token long, so every
trained token carries the signal. A fresh random model earns about 0.5.
"""

from __future__ import annotations

import pytest

from tests.test_modes import events, run_preset

STEPS = 30
WINDOW = 6


@pytest.mark.timeout(660)
@pytest.mark.parametrize("preset", ["synchronous", "fully_async"])
def test_tiny_model_reward_rises(tiny_model, tmp_path, preset):
    run_dir, _ = run_preset(preset, tiny_model, tmp_path, "reward.fn=tests.helpers.first_token:score",
                            "rollout.max_tokens=1", "trainer.lr=1e-2", f"trainer.total_steps={STEPS}",
                            "rollout.repeat=8", "data.batch_tasks=4", "explorer.tasks_per_lease=4",
                            "algorithm.skip_zero_spread=true", "algorithm.informative_wait_s=2", timeout=600)
    batches = sorted(events(run_dir, "explorer-0", "explorer_batch"), key=lambda e: e["batch_index"])
    rewards = [e["reward_mean"] for e in batches]
    assert len(rewards) >= STEPS
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    assert last >= first + 0.25, f"mean reward {first:.2f} over the first {WINDOW} batches, {last:.2f} over the last"
    steps = events(run_dir, "trainer", "train_step")
    assert len(steps) == STEPS and sum(1 for s in steps if s["samples"]) >= STEPS // 2

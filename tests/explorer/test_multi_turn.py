"""Multi-turn rollouts: the loss mask covers exactly the model's tokens."""

from __future__ import annotations

import time

import numpy as np

from rlbus.common.tasksets import GuessTaskset
from rlbus.common.trajectory import decode_payload
from rlbus.explorer.envs import make_env
from rlbus.explorer.rollout import roll_out
from rlbus.reward.base import resolve


def runs(mask):
    """(start, end) of each maximal run of ones."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def streamed_text(tok, ids) -> str:
    """A turn's text as vLLM's incremental detokenizer emits it. A token whose text would end in an incomplete
    multi-byte character is held back whole (a leading space included) until a later token completes it, so a
    turn cut by max_tokens there ends before that token."""
    end = len(ids)
    while end and tok.decode(ids[:end], skip_special_tokens=True).endswith("\ufffd"):
        end -= 1
    return tok.decode(ids[:end], skip_special_tokens=True)


def test_guess_the_number_mask_covers_exactly_the_models_tokens(engine):
    tasks = GuessTaskset(seed=3, high=20, max_turns=3)
    leases = [{"lease_id": f"t{i}.0", "task_id": f"guess-{i}", "seq": i, "batch_index": 0, "task": tasks.task(i)}
              for i in range(2)]
    groups = roll_out(engine, leases, make_env=make_env, repeat=3, temperature=1.0, top_p=1.0, max_tokens=6,
                        reward_fn=resolve("auto"), reward_name="auto", explorer="x", leased_at=time.monotonic())
    assert [len(g) for g in groups] == [3, 3]
    tok = engine.tokenizer
    saw_env_turn = False
    for meta, payload in (t for g in groups for t in g):
        body = decode_payload(payload)
        ids, mask, logp = body["response_ids"], body["loss_mask"].astype(bool), body["logprobs"]
        model_runs = runs(mask)
        # The model's turns, joined by newlines, are the episode's text (a turn may hold newlines itself).
        turns = [streamed_text(tok, ids[a:b]) for a, b in model_runs]
        assert 1 <= len(model_runs) <= 3 and "\n".join(turns) == body["text"]
        assert np.all(logp[~mask] == 0.0) and np.all(logp[mask] <= 0) and np.all(np.isfinite(logp))
        env_text = tok.decode(ids[~mask])
        if len(turns) > 1:
            saw_env_turn = True
            assert any(w in env_text for w in ("Higher.", "Lower.", "Please answer")), env_text
            assert "<|im_start|>user" in env_text and env_text.rstrip().endswith("assistant")
        assert meta["n_tokens"] == len(ids)
    assert saw_env_turn, "a random tiny model should miss at least once in 6 episodes"


def test_guess_the_number_answers_any_reply_and_ends_after_its_turns():
    """Any text the model writes gets an answer, a run of 5,000 digits too (past what int() reads)."""
    task = {"env": "guess", "answer": "7", "low": 1, "high": 10, "max_turns": 4, "task_id": "t"}
    env, again = make_env(task), "Please answer with a single number between 1 and 10."
    assert env.step("maybe 3?") == ("Higher.", False)
    assert env.step("9, no, 12") == ("Lower.", False)
    assert env.step("1" * 5000) == (again, False)
    assert env.step("no idea") == (again, True) and not env.solved
    solved = make_env(task)
    assert solved.step("it is 7") == ("Correct!", True) and solved.solved

"""Tasksets are deterministic, solvable, and load from local files with configurable fields."""

from __future__ import annotations

import json

import pytest

from rlbus.common.config import load_config
from rlbus.common.tasksets import ARITH_PROMPT, CountdownTaskset, make_taskset
from rlbus.reward.base import Response, resolve


def test_arith_is_deterministic_and_matches_the_specified_prompt():
    data = load_config(None, environ={}).data
    a, b = make_taskset(data), make_taskset(data)
    assert [a.task(i) for i in range(5)] == [b.task(i) for i in range(5)]
    t = a.task(0)
    x, y = (int(w) for w in t["prompt"].replace("?", "").split() if w.isdigit())
    assert t["prompt"] == ARITH_PROMPT.format(a=x, b=y) and int(t["answer"]) == x + y and 0 <= x <= 20
    held_out = make_taskset(data, eval_set=True)
    assert len(held_out) == 100 and held_out.task(0) != a.task(0)


def test_countdown_tasks_are_solvable_and_scored_by_the_countdown_reward():
    ts = CountdownTaskset(seed=0)
    fn = resolve("countdown")
    for i in range(20):
        t = ts.task(i)
        assert t["target"] > 0 and len(t["numbers"]) in (3, 4)
    t = {"numbers": [2, 3, 4], "target": 14, "kind": "countdown"}
    assert fn(t, Response("(2 + 3) * 4 - 6")).score == 0.0  # 6 is not given
    assert fn(t, Response("2 + 3 * 4")).score == 1.0
    assert fn(t, Response("3 * 4 + 2 = 14")).score == 1.0
    assert "once" in fn(t, Response("3 * 4 + 2 + 2")).reason
    assert fn(t, Response("__import__('os')")).score == 0.0


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "datasets"])
def test_file_tasksets_with_configurable_fields(tmp_path, fmt):
    rows = [{"question": f"q{i}", "solution": i, "source": "s"} for i in range(3)]
    if fmt == "jsonl":
        path = tmp_path / "tasks.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "tasks.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        datasets = pytest.importorskip("datasets")
        path = tmp_path / "tasks"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    data = load_config(None, ["data.taskset=file", f"data.path={path}", "data.prompt_field=question",
                              "data.answer_field=solution", "data.epochs=2"], environ={}).data
    ts = make_taskset(data)
    assert len(ts) == 6
    assert ts.task(4)["prompt"] == "q1" and ts.task(4)["answer"] == "1" and ts.task(4)["source"] == "s"


def test_file_taskset_errors_say_what_to_fix(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"q": "x", "a": 1}\n')
    data = load_config(None, ["data.taskset=file", f"data.path={path}"], environ={}).data
    with pytest.raises(ValueError, match="no field 'prompt'.*data.prompt_field"):
        make_taskset(data)
    with pytest.raises(Exception, match="needs data.path"):
        load_config(None, ["data.taskset=file"], environ={})

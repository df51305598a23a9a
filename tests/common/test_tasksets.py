"""Tasksets are deterministic, solvable, and load from local files with configurable fields."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_a_rows_kind_picks_its_reward_and_a_run_of_tasks_no_reward_scores_is_refused(tmp_path):
    """With `reward.fn: auto` every task of a file had kind 'file' (a row's own kind overwritten), which no reward
    scores: each sample scored the failure score, and the run trained on nothing."""
    from rlbus.common.config import ConfigError
    from rlbus.launcher import check_inputs

    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "1+1", "answer": "2", "kind": "math"}\n{"prompt": "2+2", "answer": "4"}\n')
    sets = ["data.taskset=file", f"data.path={path}"]
    assert [make_taskset(load_config(None, sets, environ={}).data).task(i)["kind"] for i in (0, 1)] == ["math", "file"]
    with pytest.raises(ConfigError, match="^reward.fn: auto .* tasks of data.path have kind 'file': set reward.fn"):
        check_inputs(load_config(None, sets, environ={}))
    for fix in ("reward.fn=math", "reward.service=math", "reward.terms=[{fn: exact, weight: 1.0}]"):
        check_inputs(load_config(None, [*sets, fix], environ={}))
    path.write_text('{"prompt": "1+1", "answer": "2", "kind": "math"}\n')
    check_inputs(load_config(None, sets, environ={}))
    check_inputs(load_config(None, ["explorer.eval_every=3"], environ={}))  # the default job's own tasks
    with pytest.raises(ConfigError, match="unknown reward 'nosuch'"):
        check_inputs(load_config(None, ["reward.fn=nosuch"], environ={}))


def test_a_file_taskset_has_a_held_out_set_only_when_given_one(tmp_path):
    """`data.eval_path` empty means no held-out set, as its help says: it was every training row, each one
    generated greedily at every evaluation."""
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(50)))
    held.write_text('{"prompt": "h", "answer": "1"}\n')
    data = load_config(None, ["data.taskset=file", f"data.path={train}"], environ={}).data
    assert len(make_taskset(data)) == 50 and make_taskset(data, eval_set=True) is None
    data = load_config(None, ["data.taskset=file", f"data.path={train}", f"data.eval_path={held}"], environ={}).data
    assert [t["prompt"] for t in (make_taskset(data, eval_set=True).task(0),)] == ["h"]


@pytest.mark.parametrize("rows,said", [
    # Only the first row was checked: a later one without its answer failed the broker's LEASE of that task
    # (`internal`, every time it came up), and a row that is no object likewise.
    (['{"prompt": "1+1", "answer": "2"}', '{"prompt": "2+2"}'], "row 2 has no field 'answer'"),
    (['{"prompt": "1+1", "answer": "2"}', '[1, 2]'], "row 2 is a JSON list, not an object"),
    (['{"prompt": "1+1", "answer": "2"}', '{"prompt": null, "answer": "2"}'], "row 2 has no value for 'prompt'"),
    (['{"prompt": "1+1", "answer": "2"}', 'not json'], ":2: not JSON"),
    ([], "has no rows"),
])
def test_every_row_of_a_taskset_file_is_checked_and_an_error_names_the_setting(tmp_path, rows, said):
    from rlbus.common.config import ConfigError

    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text('{"prompt": "1+1", "answer": "2"}\n')
    bad.write_text("".join(r + "\n" for r in rows))
    for sets, setting, eval_set in ((["data.path=BAD"], "data.path", False),
                                    (["data.path=GOOD", "data.eval_path=BAD"], "data.eval_path", True)):
        sets = [s.replace("BAD", str(bad)).replace("GOOD", str(good)) for s in sets]
        data = load_config(None, ["data.taskset=file", *sets], environ={}).data
        with pytest.raises(ConfigError) as exc:
            make_taskset(data, eval_set=eval_set)
        assert str(exc.value).startswith(f"{setting}: ") and said in str(exc.value)
    data = load_config(None, ["data.taskset=file", f"data.path={tmp_path / 'nope.jsonl'}"], environ={}).data
    with pytest.raises(ConfigError, match="^data.path: taskset file .*nope.jsonl does not exist"):
        make_taskset(data)


def test_a_broker_explorer_or_run_given_a_taskset_file_it_cannot_use_says_so_in_one_line(tmp_path):
    """The broker and the explorer said it in a traceback, the explorer (its held-out file) only at its first
    evaluation, mid-run; `rlbus up` said that the broker exited with 2."""
    import subprocess
    import sys

    (tmp_path / "t.jsonl").write_text('{"prompt": "1+1"}\n')
    common = ["--set", "data.taskset=file", "--set", f"run.dir={tmp_path}", "--set", "broker.port=0",
              "--set", "broker.pub_port=0"]
    for command, sets, setting in (("broker", [f"data.path={tmp_path / 't.jsonl'}"], "data.path"),
                                   ("up", [f"data.path={tmp_path / 't.jsonl'}"], "data.path"),
                                   ("explorer", [f"data.path={tmp_path / 't.jsonl'}", "explorer.eval_every=5",
                                                 f"data.eval_path={tmp_path / 'nope.jsonl'}"], "data.eval_path"),
                                   ("explorer", ["data.path=x.jsonl", "reward.fn=nosuch"], "unknown reward 'nosuch'")):
        done = subprocess.run([sys.executable, "-m", "rlbus.cli", command, *common,
                               *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stderr.startswith(f"error: {setting}"), done.stderr
        assert len(done.stderr.splitlines()) == 1, done.stderr


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "configs").rglob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_config_passes_the_checks_rlbus_up_makes_before_it_starts(path):
    from rlbus.launcher import check_inputs

    check_inputs(load_config(path, environ={}))

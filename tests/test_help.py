"""`rlbus --help` sums up every command in a line of its own; the command's own --help has the rest."""

from __future__ import annotations

import inspect

import pytest

from rlbus import cli

COMMANDS = {f"{prefix}{c.name or c.callback.__name__}": c.callback
            for prefix, group in (("", cli.app), ("config ", cli.config_app), ("model ", cli.model_app))
            for c in group.registered_commands}


def test_every_command_of_the_cli_is_here():
    assert {"broker", "up", "explorer", "trainer", "reward", "mirror", "status", "replay", "config check",
            "model prepare"} <= set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_commands_summary_is_one_sentence_on_one_line(name):
    summary = inspect.getdoc(COMMANDS[name]).split("\n\n")[0]
    assert "\n" not in summary, f"rlbus --help breaks the summary of {name!r} mid-sentence: {summary!r}"
    assert summary.endswith("."), summary


@pytest.mark.parametrize("timeout", ["nan", "-1", "0"])
def test_rlbus_status_refuses_a_timeout_that_is_no_positive_number(timeout):
    """`--timeout nan` waited for the broker for ever."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "rlbus.cli", "status", "--timeout", timeout], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "a number of seconds above 0" in done.stderr, done.stderr


def test_rlbus_model_tiny_says_what_it_cannot_make_in_one_line(tmp_path):
    """A directory under a file, or a width vLLM cannot run, was a traceback."""
    import subprocess
    import sys

    (tmp_path / "file").write_text("")
    for args, said in (([str(tmp_path / "file" / "m")], "Not a directory"),
                       ([str(tmp_path / "m"), "--hidden", "100"], "hidden=100 must be a multiple of 64")):
        done = subprocess.run([sys.executable, "-m", "rlbus.cli", "model", "tiny", *args], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and done.stderr.startswith("error: ") and said in done.stderr, done.stderr
        assert len(done.stderr.splitlines()) == 1, done.stderr


def test_rlbus_status_without_a_broker_says_so_in_one_line():
    """The client's own `broker_unreachable` warning (at 5 s of silence) came beside the error line."""
    import subprocess
    import sys

    from tests.conftest import free_port

    done = subprocess.run([sys.executable, "-m", "rlbus.cli", "status", "--broker", f"tcp://127.0.0.1:{free_port()}",
                           "--timeout", "6"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.startswith("error: no WELCOME from the broker"), done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_a_trainer_given_a_model_it_cannot_load_says_why_once(tiny_model, tmp_path):
    """A model directory without weights is a setting it cannot use: one `error: ...` line, exit 2 (it was a
    100-line traceback). Weights that do not load are an unexpected failure: its `trainer_failed` event carries the
    traceback, and the interpreter no longer prints it a second time; exit 1."""
    import json
    import shutil
    import subprocess
    import sys

    from tests.conftest import free_port

    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(f"{tiny_model}/config.json", model)

    def trainer() -> subprocess.CompletedProcess:
        port = free_port()
        return subprocess.run([sys.executable, "-m", "rlbus.cli", "trainer", "--set", f"model.path={model}",
                               "--set", f"run.dir={tmp_path / 'run'}", "--set", f"broker.port={port}",
                               "--set", f"broker.pub_port={free_port()}", "--set", "logging.format=json"],
                              capture_output=True, text=True, timeout=120)

    done = trainer()
    assert done.returncode == 2 and done.stderr == (f"error: model.path='{model}' has a config.json but no weight "
                                                    "files (.safetensors, .bin, .pt, .pth); give a whole HF model "
                                                    "directory\n"), done.stderr
    (model / "model.safetensors").write_text("not a safetensors file\n")
    done = trainer()
    assert done.returncode == 1 and done.stderr.count("Traceback (most recent call last)") == 1, done.stderr
    failed = json.loads(done.stderr.splitlines()[-1])
    assert failed["event"] == "trainer_failed" and failed["error"].startswith("SafetensorError: ")


@pytest.mark.parametrize("role", ["explorer", "trainer"])
def test_a_process_of_another_model_than_the_runs_is_refused_before_it_loads_its_own(role, broker_factory, clients,
                                                                                      tiny_model, tmp_path):
    """It asks the broker, as a tool, before its engine or its model loads (seconds here, minutes for a large model
    on a GPU), and ends with the broker's refusal at once; before, that came at its HELLO, once all had loaded.
    The ask pins nothing."""
    import subprocess
    import sys

    from rlbus.logview import events
    from rlbus.weights.models import make_tiny, model_fingerprint

    wider = model_fingerprint(str(make_tiny(tmp_path / "wider", tiny_model, hidden=192)))
    b = broker_factory()
    clients(b, "trainer" if role == "explorer" else "explorer", "pins", rollout={"model": wider})
    log = tmp_path / f"{role}.jsonl"
    done = subprocess.run([sys.executable, "-m", "rlbus.cli", role, "--broker", b.address, "--set",
                           f"broker.pub_port={b.pub_port}", "--set", f"model.path={tiny_model}", "--set",
                           f"run.dir={tmp_path / 'run'}", "--set", "rollout.dtype=float32", "--set",
                           "logging.format=json", "--set", f"logging.file={log}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stderr == (f"error: conflict: rollout.model: this peer has '{model_fingerprint(tiny_model)}', the "
                           f"run '{wider}': start it with the run's model (model.path), or use a new run directory "
                           f"for another model\n"), done.stderr  # one line
    refused, failed = events(log)  # no engine_started, nothing of a model loaded
    assert refused["event"] == "hello_refused" and refused["peer"].startswith("tool-")  # the ask's refusal
    assert failed["event"] == f"{role}_failed"
    assert [e["peer"] for e in b.log_events() if e["event"] == "rollout_model_pinned"] == ["pins"]


def test_rlbus_config_check_reads_the_taskset_a_run_would(tmp_path):
    """It said `ok` to a taskset file the broker then refused at its start."""
    import subprocess
    import sys

    rows = tmp_path / "tasks.jsonl"

    def check(text: str) -> subprocess.CompletedProcess:
        rows.write_text(text)
        return subprocess.run([sys.executable, "-m", "rlbus.cli", "config", "check", "--set", "data.taskset=file",
                               "--set", f"data.path={rows}"], capture_output=True, text=True, timeout=60)

    done = check('{"question": "1+1", "answer": "2"}\n')
    assert done.returncode == 2 and done.stderr == (f"error: data.path: taskset file {rows}: row 1 has no field "
                                                    "'prompt'; its fields are ['answer', 'question'] (set "
                                                    "data.prompt_field / data.answer_field)\n"), done.stderr
    done = check('{"prompt": "1+1", "answer": "2"}\n')  # and no reward for its rows
    assert done.returncode == 2 and done.stderr.startswith("error: reward.fn: auto scores each task by the reward "
                                                           "its kind names"), done.stderr
    done = check('{"prompt": "1+1", "answer": "2", "kind": "math"}\n')
    assert (done.returncode, done.stdout, done.stderr) == (0, "ok\n", "")


@pytest.mark.parametrize("option", [["--keep", "1"], ["--port", "65536"], ["--port", "-1"]])
def test_rlbus_mirror_refuses_what_it_cannot_keep_or_bind_before_it_starts(option):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "rlbus.cli", "mirror", *option], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and f"Invalid value for '{option[0]}'" in done.stderr, done.stderr

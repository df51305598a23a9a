"""The socket directory an engine's start gives vLLM (its own), and those of explorers that are gone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rlbus.explorer import lifeline


@pytest.fixture
def short_tmp():
    """A temporary directory with a path short enough for socket paths under it (pytest's are too long)."""
    path = Path(tempfile.mkdtemp(prefix="rl"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_an_engine_start_removes_the_socket_directories_of_gone_explorers_only(monkeypatch, short_tmp):
    monkeypatch.setattr(tempfile, "tempdir", str(short_tmp))
    monkeypatch.delenv(lifeline.RPC_ENV, raising=False)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (short_tmp / f"rlbus-vllm-{gone.pid}-x1").mkdir()
    (short_tmp / f"rlbus-vllm-{gone.pid}-x1" / "left").write_text("")
    (short_tmp / f"rlbus-vllm-{os.getppid()}-x2").mkdir()  # a live explorer's
    (short_tmp / "rlbus-vllm-notapid-x3").mkdir()
    with lifeline.owning_engines() as mine:
        assert os.environ[lifeline.RPC_ENV] == str(mine) and mine.parent == short_tmp
        assert mine.name.startswith(f"rlbus-vllm-{os.getpid()}-")
    assert sorted(p.name for p in short_tmp.iterdir()) == sorted(
        [mine.name, f"rlbus-vllm-{os.getppid()}-x2", "rlbus-vllm-notapid-x3"])
    assert lifeline.RPC_ENV not in os.environ
    lifeline.remove_sockets(mine)
    assert not mine.exists()


def test_a_directory_the_user_chose_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv(lifeline.RPC_ENV, str(tmp_path))
    with lifeline.owning_engines() as mine:
        assert mine is None and os.environ[lifeline.RPC_ENV] == str(tmp_path)
    assert os.environ[lifeline.RPC_ENV] == str(tmp_path)


def test_under_a_temporary_directory_too_long_for_its_socket_paths_vllm_keeps_its_own_place(monkeypatch,
                                                                                             tmp_path):
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    monkeypatch.delenv(lifeline.RPC_ENV, raising=False)
    with lifeline.owning_engines() as mine:
        assert mine is None and lifeline.RPC_ENV not in os.environ
    assert not list(deep.iterdir())


def test_processes_started_with_an_environment_get_it_and_this_process_keeps_its_own(monkeypatch):
    """How an engine core in a process of its own compiles nothing (tests/explorer/test_explorer_process.py):
    the setting is in its environment, not in the explorer's after the engine is built."""
    monkeypatch.setenv("RLBUS_KEPT", "before")
    monkeypatch.delenv("RLBUS_ADDED", raising=False)
    show = [sys.executable, "-c", "import os; print(os.environ['RLBUS_KEPT'], os.environ['RLBUS_ADDED'])"]
    with lifeline.started_with({"RLBUS_KEPT": "within", "RLBUS_ADDED": "1"}):
        assert subprocess.run(show, capture_output=True, text=True, check=True).stdout.split() == ["within", "1"]
    with pytest.raises(RuntimeError), lifeline.started_with({"RLBUS_ADDED": "1"}):
        raise RuntimeError("the engine failed to build")
    assert os.environ["RLBUS_KEPT"] == "before" and "RLBUS_ADDED" not in os.environ

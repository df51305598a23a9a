"""The socket directories an engine's start gives vLLM: its own, and those of explorers that are gone."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from rlbus.explorer import lifeline


def test_an_engine_start_removes_the_socket_directories_of_gone_explorers_only(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv(lifeline.RPC_ENV, raising=False)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / f"rlbus-{gone.pid}-x1").mkdir()
    (tmp_path / f"rlbus-{gone.pid}-x1" / "left").write_text("")
    (tmp_path / f"rlbus-{os.getppid()}-x2").mkdir()  # a live explorer's
    (tmp_path / "rlbus-notapid-x3").mkdir()
    with lifeline.owning_engines() as mine:
        assert os.environ[lifeline.RPC_ENV] == str(mine) and mine.parent == tmp_path
        assert mine.name.startswith(f"rlbus-{os.getpid()}-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [mine.name, f"rlbus-{os.getppid()}-x2", "rlbus-notapid-x3"])
    assert lifeline.RPC_ENV not in os.environ
    lifeline.remove_sockets(mine)
    assert not mine.exists()


def test_a_directory_the_user_chose_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv(lifeline.RPC_ENV, str(tmp_path))
    with lifeline.owning_engines() as mine:
        assert mine is None and os.environ[lifeline.RPC_ENV] == str(tmp_path)
    assert os.environ[lifeline.RPC_ENV] == str(tmp_path)

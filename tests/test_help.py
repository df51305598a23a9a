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

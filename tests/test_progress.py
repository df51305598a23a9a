"""The live views on a terminal: what `rlbus up` and `rlbus model prepare` show, and only where they should."""

from __future__ import annotations

import io
import os
import re

from rich.console import Console

from rlbus.progress import Phases, RunView, wanted


def _console() -> Console:
    return Console(file=io.StringIO(), force_terminal=True, width=120, record=True)


def test_the_run_view_shows_step_reward_accuracy_versions_depth_and_an_eta():
    console = _console()
    view = RunView(total_steps=6, console=console)
    progress = {"step": 0, "reward_mean": 0.125, "accuracy": None, "explorer_versions": {"explorer-0": 0},
                "buffer_depth": 8}
    console.print(view.render(progress, now=view.started + 1))
    first = console.export_text()
    assert re.search(r"step\s+1/6", first) and re.search(r"ETA\s+–", first), first  # no pace yet
    progress.update(step=2, reward_mean=0.25, accuracy=0.75, accuracy_version=3,
                    explorer_versions={"explorer-0": 2, "explorer-1": 3}, buffer_depth=16)
    console.print(view.render(progress, now=view.started + 11))  # 2 steps in 10 s, 3 to go
    console.print(view.render(dict(progress, reward_mean=None), now=view.started + 12))  # a step that trained nothing
    text = console.export_text()
    assert text.count("0.250") == 2, "the last reward stays"
    for shown in ("3/6", "0.250", "0.750 (v3)", "explorer-0 v2  explorer-1 v3", "16", "0:00:11", "0:00:15"):
        assert shown in text, (shown, text)


def test_the_views_are_only_for_a_terminal_and_never_instead_of_asked_for_json(tmp_path):
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as terminal, open(tmp_path / "f", "w") as file:
            assert wanted("auto", terminal) and wanted("console", terminal)
            assert not wanted("json", terminal)
            assert not wanted("auto", file)
    finally:
        os.close(master)
        os.close(slave)


def test_model_prepare_phases_say_what_runs_and_how_long_each_took():
    console = _console()
    phases = Phases("model smollm2-135m", console=console)
    phases("downloading")
    phases("converting")
    phases.close()
    text = console.export_text()
    assert "downloading took" in text and "converting took" in text

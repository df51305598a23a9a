"""One import name, and layers that hold: the package layout and the import-linter contracts in pyproject.toml.

`rlbus.broker` is the repository's `broker/` folder, `rlbus.common` its `common/` folder, and so on
(setuptools package-dir). import-linter finds a package's modules by walking its directory, so the check
runs on a tree laid out as a wheel lays it out: `rlbus/` with the mapped folders linked into it.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO

LINT = Path(sys.executable).with_name("lint-imports")


def package_tree(root: Path, copy: tuple[str, ...] = ()) -> Path:
    """`root/rlbus/...` as installed: each mapped folder linked (or copied, to change it) under rlbus/."""
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    top = root / "rlbus"
    top.mkdir(parents=True)
    for path in (REPO / mapping["rlbus"]).glob("*.py"):
        (top / path.name).symlink_to(path)
    for name, folder in mapping.items():
        if name == "rlbus":
            continue
        target = top / name.removeprefix("rlbus.")
        if target.name in copy:
            shutil.copytree(REPO / folder, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.symlink_to(REPO / folder)
    return top


def lint(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--config", str(REPO / "pyproject.toml"), "--no-cache"], cwd=tree.parent,
                          env={"PYTHONPATH": str(tree.parent), "PATH": "/usr/bin:/bin"}, capture_output=True,
                          text=True, timeout=120)


def test_the_distribution_installs_one_top_level_name(tmp_path):
    dist = importlib.metadata.distribution("rlbus")
    assert dist.read_text("top_level.txt").split() == ["rlbus"]
    assert {name for name, dists in importlib.metadata.packages_distributions().items() if "rlbus" in dists} == {
        "rlbus"}
    # Outside the checkout, the folders' own names are not importable: only rlbus.* is.
    probe = ("import importlib.util as u; import rlbus.broker.server, rlbus.cli, rlbus.weights.models;"
             "print([n for n in ('common', 'broker', 'explorer', 'trainer', 'reward', 'weights') if u.find_spec(n)])")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e '.[test]')")
def test_the_layers_hold(tmp_path):
    done = lint(package_tree(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 kept, 0 broken" in done.stdout


@pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e '.[test]')")
def test_an_import_against_the_layers_is_caught(tmp_path):
    tree = package_tree(tmp_path, copy=("common", "broker"))
    (tree / "common" / "upward.py").write_text("import torch\nfrom rlbus.trainer import main\n")
    (tree / "broker" / "heavy.py").write_text("def late():\n    import numpy\n")  # in a function: caught too
    done = lint(tree)
    assert done.returncode == 1
    assert "rlbus.common.upward -> rlbus.trainer.main" in done.stdout
    assert "rlbus.common.upward -> torch" in done.stdout
    assert "rlbus.broker.heavy -> numpy" in done.stdout


def test_no_module_over_400_lines():
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines())
             for folder in mapping.values() for p in (REPO / folder).glob("*.py")}
    assert sizes and not {p: n for p, n in sizes.items() if n > 400}

"""docker compose files: every service's command line and environment are accepted by the real CLI and config.

No Docker engine runs here, so the files cannot be run; what can be checked is
that what they ask each container to run would parse and load.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from typer.main import get_command

from rlbus.cli import app
from rlbus.common.config import load_config

REPO = Path(__file__).resolve().parent.parent


def interpolate(text: str, environ: dict[str, str]) -> str:
    """Compose's `${NAME:-default}`."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: environ.get(m[1], m[2]), text)


def services(*files, environ: dict[str, str] | None = None):
    merged: dict = {}
    for name in files:
        text = interpolate((REPO / name).read_text(), environ or {})
        for svc, spec in yaml.safe_load(text)["services"].items():
            base = merged.setdefault(svc, {})
            base["environment"] = {**base.get("environment", {}), **spec.get("environment", {})}
            base.update({k: v for k, v in spec.items() if k != "environment"})
    return merged


@pytest.mark.parametrize("files", [("docker-compose.yml",), ("docker-compose.yml", "docker-compose.gpu.yml")])
def test_every_service_command_and_environment_is_accepted(files):
    found = services(*files)
    assert {"broker", "trainer", "explorer", "reward"} <= set(found)
    cli = get_command(app)
    for name, spec in found.items():
        command = spec.get("command") or yaml.safe_load((REPO / "docker-compose.yml").read_text())[
            "services"][name]["command"]
        assert command[0] == "rlbus", name
        sub = cli.get_command(None, command[1])
        assert sub is not None, f"{name}: rlbus has no command {command[1]!r}"
        ctx = sub.make_context(command[1], list(command[2:]))  # raises on any unknown option or argument
        config = Path(str(ctx.params["config"]).replace("/app/", f"{REPO}/"))
        env = {k: str(v) for k, v in spec["environment"].items()}
        cfg = load_config(config, ctx.params.get("set") or [], environ=env)
        assert cfg.run.dir == "/data/run" and cfg.broker.address == "tcp://broker:5555", name
        if name == "broker":
            assert cfg.broker.host == "0.0.0.0" and cfg.broker.port == 5555
        if "gpu" in files[-1] and name in ("trainer", "explorer"):
            assert spec["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"


def test_the_gpu_override_runs_the_trainer_on_as_many_ranks_as_it_is_given_gpus():
    for gpus in ("1", "4"):
        spec = services("docker-compose.yml", "docker-compose.gpu.yml", environ={"TRAINER_GPUS": gpus})["trainer"]
        env = {k: str(v) for k, v in spec["environment"].items()}
        cfg = load_config(REPO / "configs" / "arith.yaml", [], environ=env)
        assert cfg.trainer.world_size == int(gpus) and cfg.trainer.device == "cuda"
        assert str(spec["deploy"]["resources"]["reservations"]["devices"][0]["count"]) == gpus


def test_explorers_scale_without_fixed_names():
    spec = services("docker-compose.yml")["explorer"]
    assert "container_name" not in spec and "--name" not in spec["command"]
    assert "RLBUS_EXPLORER__NAME" not in spec["environment"]


def test_trainer_and_explorers_share_no_volume_and_explorers_learn_where_to_fetch():
    found = services("docker-compose.yml")
    mounts = {name: {v.split(":")[0] for v in spec.get("volumes", [])} for name, spec in found.items()}
    assert not mounts["explorer"] and mounts["trainer"] and not mounts["trainer"] & mounts["broker"]
    env = {k: str(v) for k, v in found["trainer"]["environment"].items()}
    cfg = load_config(REPO / "configs" / "arith.yaml", [], environ=env)
    assert cfg.sync.serve and cfg.sync.serve_host == "0.0.0.0" and cfg.sync.serve_port == 5557
    from rlbus.weights.server import advertised

    assert advertised(cfg.sync.serve_host, cfg.sync.serve_advertise, cfg.sync.serve_port) == "tcp://trainer:5557"

"""Config: YAML, environment and --set overrides, and errors that say what to fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbus.common.config import ConfigError, RunConfig, load_config

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_config_loads(path):
    assert isinstance(load_config(path, environ={}), RunConfig)


def test_defaults_work_without_a_file():
    cfg = load_config(None, environ={})
    assert cfg.sync.max_staleness == cfg.sync.sync_offset + cfg.sync.sync_interval - 1


def test_precedence_defaults_file_env_set(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  lr: 0.5\nbroker:\n  port: 1000\n")
    cfg = load_config(f, ["trainer.lr=1e-6"], environ={"RLBUS_BROKER__PORT": "5555", "RLBUS_TRAINER__LR": "0.1"})
    assert cfg.trainer.lr == 1e-6  # --set beats environment beats file
    assert cfg.broker.port == 5555  # environment beats file


def test_off_stays_a_string_and_a_mapping_needs_braces():
    assert load_config(None, ["buffer.fsync=off"], environ={}).buffer.fsync == "off"
    assert load_config(None, [], environ={"RLBUS_BUFFER__FSYNC": "off"}).buffer.fsync == "off"
    # Every interface of both families, not the mapping YAML would read.
    assert load_config(None, ["broker.host=::"], environ={}).broker.host == "::"
    assert load_config(None, [], environ={"RLBUS_BROKER__HOST": "::"}).broker.host == "::"


@pytest.mark.parametrize("sets,needle", [
    (["broker.port=99999"], "broker.port = 99999"),
    (["sync.sync_style=sometimes"], "sync.sync_style = 'sometimes'"),
    (["trainer.lrr=1"], "trainer.lrr: unknown setting"),
    (["sync.sync_interval=4", "sync.max_staleness=1"], "set max_staleness >= 3"),
    (["notakeyvalue"], "expected key=value"),
    (["explorer.streaming=true", "sync.sync_style=async", "sync.max_staleness=2", "explorer.swap_lag=3"],
     "set swap_lag <= 2"),
    (["explorer.kv_cache_mb=0"], "explorer.kv_cache_mb = 0"),
    (["buffer.capacity=31", "rollout.repeat=8"], "buffer.capacity=31 cannot hold one batch (data.batch_tasks=4 x "
                                                  "rollout.repeat=8 = 32 trajectories): explorers would wait for room "
                                                  "that never comes; set buffer.capacity >= 32"),
    (["rollout.repeat=1"], "algorithm.advantage=grpo compares the samples of a task with each other, and "
                           "rollout.repeat=1 gives each task one: every advantage would be 0"),
    (["rollout.repeat=1", "algorithm.advantage=rloo"], "set rollout.repeat >= 2 (8 by default), or "
                                                       "algorithm.advantage=reinforce_pp"),
    (["algorithm.is_mode=mask", "algorithm.is_low=1.2"], "[is_low, is_high] = [1.2, 2.0], which leaves out 1"),
    (["algorithm.is_mode=mask", "algorithm.is_high=0.9"], "on-policy samples would all be masked; set is_low <= 1 <= "
                                                          "is_high"),
    (["data.revisit=1"], "data.revisit = 1"),
    (["data.revisit=-0.1"], "data.revisit = -0.1"),
    (["data.revisit_times=0"], "data.revisit_times = 0"),
    (["broker.address=broker-host:5555"], "broker.address = 'broker-host:5555': must be tcp://HOST:PORT"),
    (["broker.pub_address=tcp://h"], "broker.pub_address = 'tcp://h': must be tcp://HOST:PORT"),
    (["broker.address=tcp://broker-host:99999"], "broker.address = 'tcp://broker-host:99999': must be tcp://HOST:PORT"),
    (["explorer.fetch_from=tcp://mirror:0"], "explorer.fetch_from = 'tcp://mirror:0': must be tcp://HOST:PORT"),
    (["broker.host=tcp://10.0.0.5"], "broker.host = 'tcp://10.0.0.5': must be a host name or an IP address"),
    (["broker.host=broker-host:5555"], "broker.host = 'broker-host:5555': must be a host name or an IP address, "
                                       "without a port"),
    ([f"explorer.name={'x' * 129}"], "String should have at most 128 characters"),
    (["trainer.name=''"], "trainer.name = '': String should have at least 1 character"),
    (["sync.serve_host=beef:1"], "sync.serve_host = 'beef:1': must be a host name or an IP address"),
    (["sync.serve_advertise=a b"], "sync.serve_advertise = 'a b': must be a host name"),
    (["metrics.prometheus_host=h/x"], "metrics.prometheus_host = 'h/x': must be a host name"),
    (["launch.trainer_cpus=0-x"], "launch.trainer_cpus = '0-x': cpu list '0-x': use core numbers and ranges"),
    (["launch.broker_cpus=3-1"], "launch.broker_cpus = '3-1'"),
    (['launch.explorer_cpus=["0", "²"]'], "launch.explorer_cpus.1 = '²'"),
    (["trainer.lr=inf"], "trainer.lr = 'inf': Input should be a finite number"),
    (["rollout.temperature=inf"], "rollout.temperature = 'inf': Input should be a finite number"),
    (["algorithm.kl_coef=-inf"], "algorithm.kl_coef = '-inf': Input should be a finite number"),
])
def test_bad_values_name_field_value_and_remedy(sets, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, sets, environ={})
    assert needle in str(err.value)


def test_one_sample_a_task_is_enough_where_no_group_is_compared():
    assert load_config(None, ["rollout.repeat=1", "algorithm.advantage=reinforce_pp"], environ={}).rollout.repeat == 1


def test_importance_bounds_are_checked_only_where_they_mask():
    assert load_config(None, ["algorithm.is_low=1.2"], environ={}).algorithm.is_low == 1.2  # truncate: unused
    assert load_config(None, ["algorithm.is_mode=mask", "algorithm.is_low=1", "algorithm.is_high=1"],
                       environ={}).algorithm.is_mode == "mask"


@pytest.mark.parametrize("sets, address, bus", [
    ([], "tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"),
    (["broker.port=6000", "broker.pub_port=6001"], "tcp://127.0.0.1:6000", "tcp://127.0.0.1:6001"),
    (["broker.host=0.0.0.0", "broker.port=6000"], "tcp://127.0.0.1:6000", "tcp://127.0.0.1:5556"),
    (["broker.host=broker-host", "broker.port=6000"], "tcp://broker-host:6000", "tcp://broker-host:5556"),
    (["broker.host=::1", "broker.port=6000"], "tcp://[::1]:6000", "tcp://[::1]:5556"),
    (["broker.host=broker-host"], "tcp://broker-host:5555", "tcp://broker-host:5556"),
    (["broker.host=fd00::5"], "tcp://[fd00::5]:5555", "tcp://[fd00::5]:5556"),
    (["broker.host=::"], "tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"),
    (["broker.port=6000", "broker.address=tcp://far:7000"], "tcp://far:7000", "tcp://far:5556"),
    (["broker.port=0"], "tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"),  # nothing to dial: give the address
])
def test_peers_dial_the_brokers_host_and_port_unless_given_an_address(sets, address, bus):
    """One config with only `broker.port` serves the broker and its peers alike."""
    cfg = load_config(None, sets, environ={})
    assert (cfg.broker.address, cfg.bus_address()) == (address, bus)


def test_an_ipv6_host_may_come_in_brackets(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text('broker:\n  host: "[fd00::5]"\nsync:\n  serve_advertise: "[fd00::6]"\n')
    cfg = load_config(f, environ={})
    assert (cfg.broker.host, cfg.broker.address, cfg.sync.serve_advertise) == ("fd00::5", "tcp://[fd00::5]:5555",
                                                                                "fd00::6")


@pytest.mark.parametrize("host, dialled", [("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1"), ("::1", "[::1]"),
                                           ("broker-host", "broker-host")])
def test_rlbus_up_hands_its_children_the_ports_its_broker_bound_on_the_brokers_host(host, dialled):
    from rlbus.launcher import Launcher

    cfg = load_config(None, [f"broker.host={host}", "broker.port=0", "broker.pub_port=0"], environ={})
    Launcher._pin_ports(cfg, 7000, 7001)
    assert (cfg.broker.address, cfg.bus_address()) == (f"tcp://{dialled}:7000", f"tcp://{dialled}:7001")


def test_an_environment_setting_with_one_underscore_after_its_section_is_an_error_not_ignored():
    with pytest.raises(ConfigError, match="^environment RLBUS_TRAINER_LR: .* underscores .*: RLBUS_TRAINER__LR\\?$"):
        load_config(None, environ={"RLBUS_TRAINER_LR": "1e-6"})
    # rlbus's own variables that name no section are no settings
    assert load_config(None, environ={"RLBUS_ENGINE_OWNER_PID": "1", "RLBUS_STORE_FD": "3"}).trainer.lr > 0
    assert load_config(None, environ={"RLBUS_TRAINER__LR": "1e-6"}).trainer.lr == 1e-6


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(bad, environ={})


@pytest.mark.parametrize("text,said", [
    # A section or a key given twice kept the last silently: the first one's settings were lost.
    ("trainer:\n  lr: 1.0e-5\ntrainer:\n  lr: 2.0e-5\n", "found 'trainer' a second time\n  in \"{f}\", line 3"),
    ("trainer:\n  lr: 1.0e-5\n  lr: 2.0e-5\n", "found 'lr' a second time\n  in \"{f}\", line 3"),
    (b"trainer:\n  lr: \xff\n", "is not UTF-8 text"),  # was a UnicodeDecodeError traceback
])
def test_a_file_with_a_key_twice_or_not_utf8_is_refused_naming_the_line(tmp_path, text, said):
    f = tmp_path / "c.yaml"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match="c.yaml") as exc:
        load_config(f, environ={})
    assert said.format(f=f) in str(exc.value)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path, environ={})


def test_a_merge_key_overridden_is_no_key_given_twice(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("explorer:\n  tasks_per_lease: 4\ntrainer:\n  <<: {lr: 1.0e-5, warmup_steps: 7}\n"
                 "  lr: 2.0e-5\n")
    cfg = load_config(f, environ={})
    assert (cfg.trainer.lr, cfg.trainer.warmup_steps, cfg.explorer.tasks_per_lease) == (2.0e-5, 7, 4)


def test_every_field_is_documented():
    def walk(model):
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                yield from walk(ann)
            else:
                yield f"{model.__name__}.{name}", field.description

    missing = [name for name, doc in walk(RunConfig) if not doc]
    assert not missing, f"fields without a docstring: {missing}"


def test_a_component_pinned_only_to_cores_this_host_lacks_is_refused_before_anything_starts(tmp_path):
    import os

    from rlbus.launcher import Launcher

    beyond = max(os.sched_getaffinity(0)) + 1
    sets = [f"run.dir={tmp_path / 'run'}", "launch.explorers=2"]
    cfg = load_config(None, sets + [f"launch.explorer_cpus=['0', '{beyond}-{beyond + 1}']"], environ={})
    with pytest.raises(ConfigError, match=rf"launch.explorer_cpus\[1\] = '{beyond}-{beyond + 1}': none of these"):
        Launcher(cfg)
    assert not (tmp_path / "run").exists()
    # Some of them missing (the default job's "0-1" on a one-core host): it runs on the others, as Linux would.
    Launcher(load_config(None, sets + [f"launch.trainer_cpus=0-{beyond}"], environ={}))


@pytest.mark.parametrize("command, error", [
    (["trainer", "--set", "model.path={empty}"], "error: model.path='{empty}' is a directory without config.json"),
    (["reward", "--service", "nosuch"], "error: unknown reward 'nosuch': registered ones are"),
    (["model", "prepare", "nosuch"], "error: unknown bundled model 'nosuch'"),
    (["mirror", "--host", "tcp://0.0.0.0"], "error: --host and --advertise: must be a host name or an IP address"),
    (["broker", "--set", "broker.curve_secret_key={empty}/nope", "--set", "broker.curve_authorized_dir={empty}",
      "--set", "broker.port=0", "--set", "broker.pub_port=0"],
     "error: broker.curve_secret_key='{empty}/nope': no such key file (make a pair with `rlbus keys DIR NAME`)"),
    (["status", "--set", "broker.curve_server_key={empty}/nope"], "error: broker.curve_server_key='{empty}/nope'"),
])
def test_a_setting_a_component_finds_it_cannot_use_is_one_error_line_and_exit_2(tmp_path, command, error):
    """Not a traceback: a model path that is no model, a reward service nobody registered, a model not bundled, a
    key file that is not there."""
    import subprocess
    import sys

    empty = tmp_path / "empty"
    empty.mkdir()
    args = [a.format(empty=empty) for a in command]
    if command[0] != "model":
        args += ["--set", f"run.dir={tmp_path / 'run'}", "--set", "logging.format=console"]
    proc = subprocess.run([sys.executable, "-m", "rlbus.cli", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert error.format(empty=empty) in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("command, sets, error", [
    ("broker", ["run.dir={file}/run"], "error: run.dir: cannot write to '{file}/run/buffer' (Not a directory)"),
    ("broker", ["buffer.dir={file}/b"], "error: buffer.dir: cannot write to '{file}/b' (Not a directory)"),
    ("trainer", ["run.dir={file}/run"], "error: run.dir: cannot write to '{file}/run' (Not a directory)"),
    ("up", ["run.dir={file}/run"], "error: run.dir: cannot write to '{file}/run' (Not a directory)"),
    ("broker", ["logging.file={dir}"], "error: logging.file: cannot write to '{dir}' (Is a directory)"),
])
def test_a_directory_a_component_cannot_write_to_is_one_error_line_naming_its_setting(tmp_path, command, sets,
                                                                                      error):
    """Said before anything starts (nothing is bound, no model loaded), not as a traceback."""
    import subprocess
    import sys

    (tmp_path / "file").write_text("a file, not a directory")
    paths = {"file": tmp_path / "file", "dir": tmp_path}
    args = [sys.executable, "-m", "rlbus.cli", command, "--set", "broker.port=0", "--set", "broker.pub_port=0"]
    for s in sets:
        args += ["--set", s.format(**paths)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == error.format(**paths)


def test_version_names_the_package_and_the_wire_protocol():
    import subprocess
    import sys
    from importlib.metadata import version

    proc = subprocess.run([sys.executable, "-m", "rlbus.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == f"rlbus {version('rlbus')} (wire protocol rlbus/1)\n"

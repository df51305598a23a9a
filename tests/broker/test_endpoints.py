"""The broker's addresses: endpoints.json (whoever starts a broker learns the ports it bound, never an earlier
broker's), and an address it cannot bind."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from rlbus.broker import endpoints
from rlbus.common import protocol as P
from rlbus.common.client import BrokerClient
from tests.conftest import group, ipv6_loopback
from tests.helpers.waiting import wait_for


def test_ports_are_read_only_from_the_file_the_given_process_wrote(tmp_path):
    endpoints.write(tmp_path, "127.0.0.1", 5555, 5556)  # an earlier broker's file (this process's pid)
    write = f"from rlbus.broker import endpoints; endpoints.write({str(tmp_path)!r}, '127.0.0.1', 6001, 6002)"
    later = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(1); {write}; time.sleep(30)"])
    try:
        assert endpoints.bound_ports(tmp_path, later, timeout=60) == (6001, 6002)
    finally:
        later.kill()
        later.wait()
    assert not list(tmp_path.glob("*.tmp"))


def test_a_broker_that_exits_before_serving_gives_none_and_one_that_never_serves_times_out(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert endpoints.bound_ports(tmp_path, gone, timeout=60) is None and gone.returncode == 3
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(TimeoutError, match="did not serve within 0.5 s"):
            endpoints.bound_ports(tmp_path, silent, timeout=0.5)
    finally:
        silent.kill()
        silent.wait()


def test_an_address_the_broker_cannot_bind_is_one_error_line_and_exit_1(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:  # a port in use; an address of no interface here (TEST-NET-1: nothing is sent)
        cases = {(f"broker.port={port}", "broker.host=127.0.0.1"): f"cannot serve on tcp://127.0.0.1:{port}",
                 ("broker.port=0", "broker.host=192.0.2.1"): "cannot serve on tcp://192.0.2.1:*"}
        for n, (settings, said) in enumerate(cases.items()):
            sets = [*settings, "broker.pub_port=0", f"run.dir={tmp_path / f'b{n}'}", "logging.format=json"]
            args = [a for s in sets for a in ("--set", s)]
            run = subprocess.run([sys.executable, "-m", "rlbus.cli", "broker", *args], capture_output=True, text=True,
                                 timeout=60)
            assert run.returncode == 1, run.stderr[-2000:]
            failed = [json.loads(line) for line in (run.stdout + run.stderr).splitlines()
                      if '"broker_bind_failed"' in line]
            assert len(failed) == 1 and failed[0]["error"].startswith(said), run.stdout + run.stderr
            assert "Traceback" not in run.stderr
    finally:
        taken.close()


def _broker_exit(data_dir, event: str) -> dict:
    """`rlbus broker` on `data_dir`, expected to refuse to start: its one `event` line (exit 1, no traceback)."""
    sets = ["broker.port=0", "broker.pub_port=0", f"run.dir={data_dir}", f"buffer.dir={data_dir}",
            "logging.format=json"]
    run = subprocess.run([sys.executable, "-m", "rlbus.cli", "broker", *[a for s in sets for a in ("--set", s)]],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    said = [json.loads(line) for line in (run.stdout + run.stderr).splitlines() if f'"{event}"' in line]
    assert len(said) == 1, run.stdout + run.stderr
    return said[0]


def test_a_second_broker_on_a_buffer_directory_in_use_is_refused_and_the_first_goes_on(broker_factory, clients):
    """Two brokers on one directory both ran, writing the same segment file and catalogue."""
    first = broker_factory()
    said = _broker_exit(first.data_dir, "broker_dir_in_use")
    assert f"a broker that runs (pid {first.proc.pid})" in said["error"] and str(first.data_dir) in said["error"]
    ex = clients(first, "explorer", "ex")
    assert ex.put(group("g"), timeout=5)["stored"] == ["g.0", "g.1"]
    assert json.loads((first.data_dir / endpoints.NAME).read_text())["pid"] == first.proc.pid
    first.kill()  # SIGKILL: the lock goes with the process
    first.start()
    assert clients(first, "tool", "st").request(P.STATUS, timeout=5).header["buffer"]["stored"] == 2


def test_a_catalogue_that_is_no_database_is_one_error_line_naming_it(tmp_path):
    (tmp_path / "buffer.sqlite3").write_bytes(bytes(range(256)) * 32)
    said = _broker_exit(tmp_path, "broker_catalogue_unreadable")
    assert said["error"].startswith(f"{tmp_path / 'buffer.sqlite3'}: file is not a database; move the buffer")


def test_a_peer_given_only_the_brokers_port_reaches_it(broker, clients):
    """`rlbus status` with the broker's `broker.port` and no `broker.address` asks that broker, not the default
    port's."""
    run_id = clients(broker, "tool", "look").welcome["run_id"]
    run = subprocess.run([sys.executable, "-m", "rlbus.cli", "status", "--set", f"broker.port={broker.port}"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["run_id"] == run_id


@ipv6_loopback
@pytest.mark.parametrize("host, dialled", [("::1", ["[::1]"]), ("::", ["[::1]", "127.0.0.1"])])
def test_a_broker_on_an_ipv6_address_serves_peers_and_the_bus_there(broker_factory, host, dialled):
    """A broker bound to an IPv6 address (`::`: every interface, both families) is reached at its address in
    brackets, as docs/protocol.md writes them: requests, the weight-version bus, and `rlbus status` given only
    the broker's host and port."""
    broker = broker_factory(f"broker.host={host}")
    bound = json.loads((broker.data_dir / endpoints.NAME).read_text())
    assert bound["router"] == f"tcp://[{host}]:{broker.port}"
    for version, at in enumerate(dialled, 1):
        made = [BrokerClient(f"tcp://{at}:{broker.port}", role, f"{role}-{version}", heartbeat_interval_s=0.2,
                             bus_address=f"tcp://{at}:{broker.pub_port}") for role in ("explorer", "trainer")]
        explorer, trainer = made
        try:
            for c in made:
                c.start(10)
            trainer.request(P.PUBLISH, {"version": version, "method": "checkpoint", "location": f"/w/v{version}",
                                        "digest": "abc", "fetch_from": "tcp://[::1]:5557"})
            wait_for(lambda: explorer.weights and explorer.weights["version"] == version, 10, "the version on the bus")
        finally:
            for c in made:
                c.close(timeout=1)
    run = subprocess.run([sys.executable, "-m", "rlbus.cli", "status", "--set", f"broker.host={host}",
                          "--set", f"broker.port={broker.port}"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["weights"]["version"] == len(dialled)

"""The broker's addresses: endpoints.json (whoever starts a broker learns the ports it bound, never an earlier
broker's), serving on a Unix socket beside TCP, and an address it cannot bind."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rlbus.broker import endpoints
from rlbus.common import protocol as P
from rlbus.common.client import BrokerClient
from rlbus.common.config import ConfigError, load_config
from tests.conftest import group


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


@pytest.fixture
def ipc_dir():
    """A short directory for Unix sockets (a path holds 107 bytes; pytest's tmp_path can come close)."""
    d = Path(tempfile.mkdtemp(prefix="rlbus-ipc-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_broker_with_an_ipc_path_serves_requests_and_the_bus_there_as_over_tcp(broker_factory, clients, ipc_dir):
    path = ipc_dir / "sock" / "broker"  # the directory is made by the broker
    b = broker_factory(f"broker.ipc_path={path}", "broker.republish_interval_s=0.2")
    bound = json.loads((b.data_dir / endpoints.NAME).read_text())
    assert bound["router_ipc"] == f"ipc://{path}" and bound["pub_ipc"] == f"ipc://{path}.bus"
    cfg = load_config(None, [f"broker.address=ipc://{path}"])
    assert cfg.bus_address() == f"ipc://{path}.bus"
    local = []
    try:
        for role, name in (("explorer", "ex-ipc"), ("trainer", "tr-ipc")):
            c = BrokerClient(f"ipc://{path}", role, name, bus_address=cfg.bus_address(), heartbeat_interval_s=0.2)
            local.append(c)
            c.start(10)
        ex, tr = local
        assert ex.put(group("g0"), timeout=10)["stored"] == ["g0.0", "g0.1"]
        batch = tr.request(P.FETCH, {"step": 0, "max_groups": 1})
        assert batch.command == P.BATCH
        parts = P.split_payloads(batch.header["groups"][0]["trajectories"], batch.payloads)
        assert [bytes(p) for p in parts] == [b"payload-of-g0.0", b"payload-of-g0.1"]
        assert tr.request(P.COMMIT, {"step": 0}).command == P.OK
        deadline = time.monotonic() + 10
        while ex.weights is None and time.monotonic() < deadline:  # the bus, republished every 0.2 s
            time.sleep(0.05)
        assert ex.weights is not None and ex.weights["version"] == 0
        over_tcp = clients(b, "tool", "tcp-tool")  # the same broker, the same state, over TCP
        status = over_tcp.request(P.STATUS).header
        assert {"ex-ipc", "tr-ipc"} <= {p["name"] for p in status["peers"]}
        assert status["buffer"]["committed"] == 2
    finally:
        for c in local:
            c.close(bye=True, timeout=2)


def test_an_address_the_broker_cannot_bind_is_one_error_line_and_exit_1(tmp_path, ipc_dir):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        cases = {f"broker.port={port}": f"cannot serve on tcp://127.0.0.1:{port}",
                 f"broker.ipc_path={ipc_dir}/file/broker": f"cannot serve on ipc://{ipc_dir}/file/broker"}
        (ipc_dir / "file").write_text("not a directory")
        for n, (setting, said) in enumerate(cases.items()):
            d = tmp_path / f"b{n}"
            run = subprocess.run([sys.executable, "-m", "rlbus.cli", "broker", "--set", setting, "--set",
                                  "broker.pub_port=0", "--set", f"run.dir={d}", "--set", "logging.format=json"],
                                 capture_output=True, text=True, timeout=60)
            assert run.returncode == 1, run.stderr[-2000:]
            failed = [json.loads(line) for line in (run.stdout + run.stderr).splitlines()
                      if '"broker_bind_failed"' in line]
            assert len(failed) == 1 and failed[0]["error"].startswith(said), run.stdout + run.stderr
            assert "Traceback" not in run.stderr
    finally:
        taken.close()


def test_an_ipc_path_too_long_for_a_unix_socket_is_a_config_error():
    with pytest.raises(ConfigError, match="broker.ipc_path is 120 bytes long"):
        load_config(None, [f"broker.ipc_path=/{'x' * 119}"])
    assert load_config(None, [f"broker.ipc_path=/{'x' * 102}"]).broker.ipc_path  # 103 + ".bus": 107 bytes

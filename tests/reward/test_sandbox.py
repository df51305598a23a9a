"""The code sandbox contains hostile programs, scores 0 with the reason, and harms nothing."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from rlbus.reward.sandbox import Limits, Sandbox, capabilities


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(Limits(cpu_s=1, wall_s=3, memory_mb=256, processes=8, file_mb=1))


def test_passing_and_failing_tests_score_the_fraction(sandbox):
    r = sandbox.run_tests("def add(a, b):\n    return a + b", ["assert add(1, 2) == 3", "assert add(2, 2) == 5"])
    assert r.score == 0.5 and r.reason.startswith("test failed") and "AssertionError" in r.reason
    r = sandbox.run_tests("print(int(input()) * 2)", [{"input": "21", "output": "42"}, {"input": "1", "output": "3"}])
    assert r.score == 0.5 and r.reason == "wrong output"


@pytest.mark.parametrize("program,reason", [
    ("while True:\n    pass", "CPU time limit"),
    ("import time\ntime.sleep(60)", "wall-clock timeout"),
    # Limits the program meets as errors: the reason is its exit status, quoting what it said.
    ("import os\nwhile True:\n    os.fork()", "exit code 1: the program said 'BlockingIOError"),
    ("x = bytearray(2 * 1024 ** 3)", "exit code 1: the program said 'MemoryError"),
    ("print('x' * (4 * 1024 * 1024))", "exit code 1: the program said 'OSError: [Errno 27] File too large"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", "exit code 1: the program said 'PermissionError"),
])
def test_runaway_programs_are_stopped_with_the_reason(sandbox, program, reason):
    r = sandbox.run_tests(program, ["pass"])
    assert r.score == 0.0 and reason in r.reason, r.reason


@pytest.mark.parametrize("without", [(), ("pid_namespace",)], ids=["pid-namespace", "subreaper"])
@pytest.mark.parametrize("seen", ["by a pidfd", "by polling (a kernel before 5.3)"])
def test_the_end_of_a_program_is_seen_at_once_and_a_sleeper_at_the_wall_clock(monkeypatch, seen, without):
    import time

    sandbox = Sandbox(Limits(cpu_s=1, wall_s=3, memory_mb=256, processes=8, file_mb=1), without=without)
    if seen != "by a pidfd":  # in the parent, and in the subreaper (forked with the patch in place)
        monkeypatch.setattr(os, "pidfd_open", lambda pid: (_ for _ in ()).throw(OSError(38, "Function not implemented")))
    run = sandbox.run_one("print(6 * 7)")
    assert (run.code, run.stdout, run.timed_out) == (0, "42\n", False)
    started = time.monotonic()
    run = sandbox.run_one("import time\ntime.sleep(60)")
    assert run.timed_out and sandbox.limits.wall_s <= time.monotonic() - started < sandbox.limits.wall_s + 5


def test_a_program_cannot_forge_the_sandbox_reason(sandbox):
    r = sandbox.run_tests("import sys\nsys.stderr.write('CPU time limit (1 s)\\n')\nsys.exit(3)", ["pass"])
    assert r.reason == "exit code 3: the program said 'CPU time limit (1 s)'", r.reason


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
        assert r.score == 0.0 and "Network is unreachable" in r.reason, r.reason
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
        assert r.score == 0.0 and "PermissionError" in r.reason, r.reason
    assert not target.exists()
    r = sandbox.run_tests("open('inside.txt', 'w').write('x')\nprint(open('inside.txt').read())",
                          [{"input": "", "output": "x"}])
    assert r.score == 1.0, r.reason


@pytest.mark.parametrize("without", [(), ("drop_to_nobody",)], ids=["as-configured", "same-user-as-host"])
def test_no_other_process_can_be_signalled_or_traced(without):
    """Sandboxed code cannot signal, trace or write into processes of the host, even running as the reward
    process's own user (a host where it is not root: here simulated by not dropping to `nobody`)."""
    if not capabilities()["no_signals"]:
        pytest.skip("no seccomp filter for this architecture; see docs/architecture.md for what holds then")
    box = Sandbox(Limits(cpu_s=1, wall_s=3, memory_mb=256, processes=8, file_mb=1), without=without)
    victim = subprocess.Popen(["sleep", "60"])
    try:
        attacks = [f"os.kill({victim.pid}, signal.SIGKILL)", f"os.killpg({victim.pid}, signal.SIGKILL)",
                   f"signal.pthread_kill and os.kill({os.getpid()}, signal.SIGTERM)",
                   f"os.pidfd_open({victim.pid}) and signal.pidfd_send_signal(os.pidfd_open({victim.pid}), 9)",
                   "import ctypes; assert ctypes.CDLL(None).ptrace(16, %d, 0, 0) == 0" % victim.pid]
        for attack in attacks:
            r = box.run_tests(f"import os, signal\n{attack}", ["pass"])
            assert r.score == 0.0, (attack, r.reason)
            assert victim.poll() is None, f"the sandboxed code killed a host process: {attack}"
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize("without", [(), ("pid_namespace",)], ids=["pid-namespace", "subreaper"])
@pytest.mark.parametrize("ending", ["exits", "times out"])
def test_nothing_a_program_started_outlives_it(ending, without):
    """A child that leaves the program's process group (setsid) and sleeps was out of reach of the group kill and
    outlived the run, holding one of `nobody`'s few processes: enough such runs and every program that forks
    failed. The program's PID namespace ends with it, and every process in it; on a host that allows no PID
    namespace (here: the layer left out), the process above the program is its subreaper, and kills what is left
    below it as the run ends."""
    import secrets
    import time

    if not capabilities()["pid_namespace"] and not without:
        pytest.skip("this host allows no PID namespace; the subreaper case runs instead")
    sandbox = Sandbox(Limits(cpu_s=1, wall_s=3, memory_mb=256, processes=8, file_mb=1), without=without)
    token = secrets.token_hex(8)  # names the sleeper's command line, to look for it among the host's processes
    sleeper = "open('up', 'w').close(); import time; time.sleep(60)"
    program = ("import os, sys, time\n"
               "if os.fork() == 0:\n"
               "    os.setsid()\n"
               f"    os.execv(sys.executable, [sys.executable, '-c', {sleeper!r}, '{token}'])\n"
               "while not os.path.exists('up'):\n"
               "    time.sleep(0.01)\n"
               "print('sleeper up', flush=True)\n"
               + ("time.sleep(60)\n" if ending == "times out" else ""))
    started = time.monotonic()
    run = sandbox.run_one(program)
    assert run.stdout == "sleeper up\n" and run.timed_out == (ending == "times out")
    assert time.monotonic() - started < 10

    def alive() -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and token.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # gone meanwhile
                pass
        return found

    # The kernel tears a namespace down as its first process ends; after a wall-clock kill, that ending runs on
    # while the parent reaps its own child (a few milliseconds here). Without the namespace, the sleeper ran on.
    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert alive() == [], "a process the program started is still running"


def test_the_words_quoted_are_the_exception_a_program_died_of_even_when_a_forked_childs_traceback_ends_last():
    from rlbus.reward.sandbox import _last_said

    parent = 'Traceback (most recent call last):\n  File "main.py", line 3, in <module>\n    os.fork()\n' \
             "BlockingIOError: [Errno 11] Resource temporarily unavailable\n"
    child_cut_short = 'Traceback (most recent call last):\n  File "main.py", line 3, in <module>\n'
    assert _last_said(parent + child_cut_short) == "BlockingIOError: [Errno 11] Resource temporarily unavailable"
    assert _last_said("  only indented\n") == "  only indented" and _last_said("\n \n") == ""
    assert _last_said("first\nlast words\n") == "last words"


def test_a_parent_with_a_large_address_space_starts_programs_from_any_call_depth():
    """An explorer holds gigabytes of address space (vLLM, torch). The child the sandbox forks set its address-space
    limit before the rest of its set-up, and then any Python call that needed fresh memory failed: every program
    started from some call depths (92 and 93 frames here) raised "Exception occurred in preexec_fn"."""
    import sys
    import textwrap

    script = textwrap.dedent("""
        import mmap
        held = [mmap.mmap(-1, 1 << 30) for _ in range(2)]  # reserved, never touched
        from rlbus.reward.sandbox import Sandbox
        sandbox, failed = Sandbox(), []
        def at(depth, n):
            if depth:
                return at(depth - 1, n)
            try:
                assert sandbox.run_one("print(6 * 7)").stdout == "42\\n"
            except Exception as exc:
                failed.append((n, repr(exc)))
        for n in range(200):
            at(n, n)
        print(failed)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout == "[]\n", (done.stdout[-2000:], done.stderr[-2000:])

"""Run untrusted code against test cases, one child process per test.

Each test runs `python -I` in a fresh private directory with, in this order
(in the child, before exec):

1. a new PID namespace, which ends with the program: the kernel then ends
   every process the program started, those that left its process group too
   (the child forks into it, twice: its first process only waits); where the
   host allows none, the child forks once and stays above the program as its
   subreaper instead, and kills what is left below it when the run ends;
2. a new network namespace (only a down loopback inside: no network);
3. when started as root, the user `nobody` (root ignores the process limit);
4. resource limits: CPU seconds, address space, file size (which also caps
   stdout and stderr, written to files), processes, open files, no core;
5. Landlock: writes are allowed only beneath the private directory (reads
   are not restricted, Python needs its stdlib);
6. seccomp: no signals to any other process (kill, tkill, tgkill,
   rt_sigqueueinfo, rt_tgsigqueueinfo, pidfd_send_signal fail with EPERM) and
   no ptrace or process_vm_writev, so code running as the reward process's
   own user (a host where it is not root) cannot stop or alter it;

and the parent ends the run at the wall-clock timeout: it kills the whole
process group (the subreaper: it tells it, and kills the group should it not
have ended within `SWEEP_S`).
Failure reasons come from what the parent observes (exit status, signal,
CPU time used, the wall clock), never from what the program prints: stderr is
only quoted.

Where a layer is not available (no CAP_SYS_ADMIN for namespaces, a kernel
without Landlock, not root so no drop to `nobody`), `capabilities()` says so,
`Sandbox` logs it once, and that layer is skipped; docs/architecture.md says
what then still holds. A test is a Python snippet run after the candidate's
code (e.g. `assert add(1, 2) == 3`) or a map `{"input": stdin, "output":
expected stdout}`. Score = fraction of tests passed; every failure has a
reason.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import structlog

from rlbus.reward.reaping import CLONE_NEWPID, SWEEP_S, ends_by, into_own_pid_namespace, under_subreaper

log = structlog.get_logger()

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
# Syscalls that reach another process: signals, tracing, writing its memory (per architecture).
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_CROSS_PROCESS = {
    "x86_64": {"kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297,
               "pidfd_send_signal": 424, "ptrace": 101, "process_vm_writev": 311},
    "aarch64": {"kill": 129, "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138, "rt_tgsigqueueinfo": 240,
                "pidfd_send_signal": 424, "ptrace": 117, "process_vm_writev": 271},
}
SYS_landlock_create_ruleset, SYS_landlock_add_rule, SYS_landlock_restrict_self = 444, 445, 446
LANDLOCK_RULE_PATH_BENEATH = 1
# Every write-like filesystem right of Landlock ABI 1-3 (truncate is ABI 3).
_WRITE_RIGHTS_V1 = (1 << 1) | (1 << 4) | (1 << 5) | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) | \
    (1 << 11) | (1 << 12)
_REFER, _TRUNCATE = 1 << 13, 1 << 14


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def _seccomp_program() -> ctypes.Array | None:
    """A BPF filter answering EPERM to every cross-process syscall, or None on an unknown architecture."""
    arch = os.uname().machine
    if arch not in _CROSS_PROCESS:
        return None
    # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_JMP|BPF_JGE|BPF_K, BPF_RET|BPF_K
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    eperm = SECCOMP_RET_ERRNO | 1
    numbers = sorted(_CROSS_PROCESS[arch].values())
    n = len(numbers)
    prog = [(ld, 0, 0, 4),  # seccomp_data.arch
            (jeq, 1, 0, _AUDIT_ARCH[arch]),
            (ret, 0, 0, eperm),  # another syscall ABI (i386 on x86_64): nothing of it is allowed
            (ld, 0, 0, 0),  # seccomp_data.nr
            (jge, n + 1, 0, 0x40000000)]  # the x32 ABI's numbers: denied too
    prog += [(jeq, n - i, 0, nr) for i, nr in enumerate(numbers)]
    prog += [(ret, 0, 0, SECCOMP_RET_ALLOW), (ret, 0, 0, eperm)]
    return (_SockFilter * len(prog))(*[_SockFilter(*p) for p in prog])


_SECCOMP = _seccomp_program()


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


@dataclass
class Limits:
    cpu_s: int = 2
    memory_mb: int = 512
    file_mb: int = 4
    processes: int = 16
    open_files: int = 64
    wall_s: float = 5.0


@dataclass
class TestResult:
    passed: bool
    reason: str = ""
    seconds: float = 0.0


@dataclass
class SandboxResult:
    score: float
    tests: list[TestResult] = field(default_factory=list)

    @property
    def reason(self) -> str:
        failed = [t.reason for t in self.tests if not t.passed]
        return "; ".join(dict.fromkeys(failed))


def _landlock_abi() -> int:
    return _libc.syscall(SYS_landlock_create_ruleset, None, 0, 1)


@lru_cache(maxsize=1)
def capabilities() -> dict[str, bool]:
    """Which isolation layers this host allows (probed once, in a throwaway child)."""
    probe = subprocess.run([sys.executable, "-c", "import ctypes,sys; u = ctypes.CDLL(None).unshare;"
                            f"sys.exit((u({CLONE_NEWNET}) != 0) | (u({CLONE_NEWPID}) != 0) << 1)"],
                           capture_output=True)
    failed = probe.returncode if 0 <= probe.returncode < 4 else 3
    return {"pid_namespace": not failed & 2, "network_namespace": not failed & 1, "landlock": _landlock_abi() > 0,
            "drop_to_nobody": os.geteuid() == 0, "no_signals": _SECCOMP is not None}


def _confine(directory: str, limits: Limits, caps: dict[str, bool], wake: int | None) -> None:
    """Runs in the child between fork and exec: every layer in order."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the scoring thread gone, the program goes too
    if caps["pid_namespace"]:
        into_own_pid_namespace()
    elif wake is not None:
        under_subreaper(wake)
    if caps["network_namespace"] and _libc.unshare(CLONE_NEWNET) != 0:
        os._exit(97)
    if caps["drop_to_nobody"]:
        nobody = pwd.getpwnam("nobody")
        os.setgroups([])
        os.setgid(nobody.pw_gid)
        os.setuid(nobody.pw_uid)
    if caps["landlock"]:
        abi = _landlock_abi()
        rights = _WRITE_RIGHTS_V1 | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
        attr = _RulesetAttr(rights)
        ruleset = _libc.syscall(SYS_landlock_create_ruleset, ctypes.byref(attr), ctypes.sizeof(attr), 0)
        fd = os.open(directory, os.O_PATH)
        rule = _PathBeneath(rights, fd)
        ok = ruleset >= 0 and _libc.syscall(SYS_landlock_add_rule, ruleset, LANDLOCK_RULE_PATH_BENEATH,
                                            ctypes.byref(rule), 0) == 0
        ok = ok and _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
        ok = ok and _libc.syscall(SYS_landlock_restrict_self, ruleset, 0) == 0
        if not ok:
            os._exit(98)
    if caps["no_signals"]:
        prog = _SockFprog(len(_SECCOMP), ctypes.cast(_SECCOMP, ctypes.POINTER(_SockFilter)))
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
                _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
            os._exit(96)
    # The limits last, the address space last of all: this child is still a copy of its parent (an explorer
    # holds gigabytes of address space), so a Python call after that limit that needs fresh memory (a new chunk
    # of the frame stack, a new arena) would fail, as it does from some call depths.
    mb = 1 << 20
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * mb, limits.file_mb * mb))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))


@dataclass
class Run:
    """What the parent observed of one confined program."""

    code: int | None  # exit code, or minus the signal that ended it
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    cpu_s: float  # user + system CPU time of the program


def _reason(run: Run, limits: Limits) -> str:
    """Why a program failed, from the exit status, the CPU time and the clock (never from its output:
    a hostile program can print anything). What it said last is quoted as its own words (`_last_said`)."""
    tail = _last_said(run.stderr)
    said = f": the program said {tail!r}" if tail else ""
    code = run.code
    if run.timed_out:
        return f"wall-clock timeout ({limits.wall_s} s)"
    if code == -signal.SIGXCPU or (code == -signal.SIGKILL and run.cpu_s >= limits.cpu_s):
        return f"CPU time limit ({limits.cpu_s} s)"
    if code == -signal.SIGXFSZ:
        return f"file or output size limit ({limits.file_mb} MB)"
    if code in (95, 96, 97, 98):
        return f"sandbox could not be set up (exit code {code})"
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"killed by signal {name}{said}"
    return f"exit code {code}{said}"


def _last_said(stderr: str) -> str:
    """The last line of `stderr` that is not part of a traceback's frames (indented) or its header: the
    exception a Python program died of. Not simply the last line: the processes a program forked share its
    stderr, and a child's traceback can end after the parent's."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    said = [line for line in lines if not line[0].isspace() and line != "Traceback (most recent call last):"]
    return (said or lines or [""])[-1][:200]


def _world_executable(path: str) -> bool:
    """Whether a user with no special rights can run `path` (every directory on the way searchable)."""
    real = Path(os.path.realpath(path))
    if not real.is_file() or not real.stat().st_mode & 0o001:
        return False
    return all(parent.stat().st_mode & 0o001 for parent in real.parents)


def _interpreter(dropping: bool) -> str:
    """The Python the sandbox runs: this one, unless `nobody` cannot reach it (e.g. under /root)."""
    candidates = [sys.executable, shutil.which("python3") or "", "/usr/bin/python3"]
    for path in candidates:
        if path and (not dropping or _world_executable(path)):
            return path
    raise RuntimeError("no Python interpreter the sandbox user can run; set reward.sandbox_python")


class Sandbox:
    def __init__(self, limits: Limits | None = None, root: str | None = None, python: str = "",
                 without: tuple[str, ...] = ()):
        """`without` names layers to leave out even where the host has them (tests use it to run as a
        host without them would, e.g. `("drop_to_nobody",)` for a reward process that is not root)."""
        self.limits = limits or Limits()
        self.root = root
        self.caps = {k: v and k not in without for k, v in capabilities().items()}
        self.python = python or _interpreter(self.caps["drop_to_nobody"])
        missing = [k for k, v in self.caps.items() if not v]
        if missing:
            log.warning("sandbox_layers_missing", missing=missing)

    def run_one(self, program: str, stdin: str = "") -> Run:
        """Run one program confined, up to the wall-clock limit; what the parent saw of it."""
        work = Path(tempfile.mkdtemp(prefix="rlbus-sandbox-", dir=self.root))
        # Without a PID namespace, a pipe to the subreaper: written to at the wall clock, closed as the run ends.
        wake = None if self.caps["pid_namespace"] else os.pipe()
        try:
            work.chmod(0o700)
            if self.caps["drop_to_nobody"]:
                nobody = pwd.getpwnam("nobody")
                os.chown(work, nobody.pw_uid, nobody.pw_gid)
            (work / "main.py").write_text(program)
            (work / "stdin.txt").write_text(stdin)
            out = open(work / "stdout.txt", "wb")
            err = open(work / "stderr.txt", "wb")
            started = time.monotonic()
            proc = subprocess.Popen([self.python, "-I", "main.py"], cwd=work, stdin=open(work / "stdin.txt"),
                                    stdout=out, stderr=err, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                                    start_new_session=True, close_fds=True, pass_fds=wake[:1] if wake else (),
                                    preexec_fn=lambda: _confine(str(work), self.limits, self.caps,
                                                                wake[0] if wake else None))
            out.close()
            err.close()
            status, usage, timed_out = self._wait(proc, started + self.limits.wall_s, wake[1] if wake else None)
            seconds = time.monotonic() - started
            cap = self.limits.file_mb << 20
            read = lambda name: (work / name).read_bytes()[:cap].decode("utf-8", "replace")  # noqa: E731
            return Run(os.waitstatus_to_exitcode(status), read("stdout.txt"), read("stderr.txt"), timed_out,
                       seconds, usage.ru_utime + usage.ru_stime)
        finally:
            for fd in wake or ():
                os.close(fd)
            shutil.rmtree(work, ignore_errors=True)

    @staticmethod
    def _wait(proc: subprocess.Popen, deadline: float, wake: int | None):
        """Reap the program (with its resource usage) by the deadline, then kill its whole group. A subreaper
        (`wake`) is told at the deadline, and ends the run itself: its group is killed only should it not
        have ended within SWEEP_S."""
        timed_out = not ends_by(proc.pid, deadline)
        if timed_out and wake is not None:
            os.write(wake, b"x")
        if timed_out and (wake is None or not ends_by(proc.pid, time.monotonic() + SWEEP_S)):
            os.killpg(proc.pid, signal.SIGKILL)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it forked too
        except (ProcessLookupError, PermissionError):
            pass
        return status, usage, timed_out

    def run_tests(self, code: str, tests: list[Any]) -> SandboxResult:
        results = []
        for test in tests:
            if isinstance(test, dict):
                run = self.run_one(code, str(test.get("input", "")))
                ok = run.code == 0 and not run.timed_out and run.stdout.strip() == str(test.get("output", "")).strip()
                reason = "" if ok else ("wrong output" if run.code == 0 and not run.timed_out
                                        else _reason(run, self.limits))
            else:
                run = self.run_one(f"{code}\n\n{test}\n")
                ok = run.code == 0 and not run.timed_out
                reason = "" if ok else _reason(run, self.limits)
                if not ok and run.code == 1 and "AssertionError" in run.stderr:
                    reason = "test failed: " + reason  # the test's assertion (the quote says which)
            results.append(TestResult(ok, reason, run.seconds))
        return SandboxResult(sum(r.passed for r in results) / max(1, len(results)), results)

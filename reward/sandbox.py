"""Run untrusted code against test cases, one child process per test.

Each test runs `python -I` in a fresh private directory with, in this order
(in the child, before exec):

1. a new network namespace (only a down loopback inside: no network);
2. when started as root, the user `nobody` (root ignores the process limit);
3. resource limits: CPU seconds, address space, file size (which also caps
   stdout and stderr, written to files), processes, open files, no core;
4. Landlock: writes are allowed only beneath the private directory (reads
   are not restricted, Python needs its stdlib);

and the parent kills the whole process group at the wall-clock timeout.

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

log = structlog.get_logger()

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000
PR_SET_NO_NEW_PRIVS = 38
SYS_landlock_create_ruleset, SYS_landlock_add_rule, SYS_landlock_restrict_self = 444, 445, 446
LANDLOCK_RULE_PATH_BENEATH = 1
# Every write-like filesystem right of Landlock ABI 1-3 (truncate is ABI 3).
_WRITE_RIGHTS_V1 = (1 << 1) | (1 << 4) | (1 << 5) | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) | \
    (1 << 11) | (1 << 12)
_REFER, _TRUNCATE = 1 << 13, 1 << 14


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
    probe = subprocess.run([sys.executable, "-c", "import ctypes,sys;"
                            "sys.exit(0 if ctypes.CDLL(None).unshare(0x40000000) == 0 else 1)"],
                           capture_output=True)
    return {"network_namespace": probe.returncode == 0, "landlock": _landlock_abi() > 0,
            "drop_to_nobody": os.geteuid() == 0}


def _confine(directory: str, limits: Limits, caps: dict[str, bool]) -> None:
    """Runs in the child between fork and exec: every layer in order."""
    if caps["network_namespace"] and _libc.unshare(CLONE_NEWNET) != 0:
        os._exit(97)
    if caps["drop_to_nobody"]:
        nobody = pwd.getpwnam("nobody")
        os.setgroups([])
        os.setgid(nobody.pw_gid)
        os.setuid(nobody.pw_uid)
    mb = 1 << 20
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * mb, limits.file_mb * mb))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
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


def _reason(code: int | None, stderr: str, timed_out: bool, limits: Limits) -> str:
    tail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if timed_out:
        return f"wall-clock timeout ({limits.wall_s} s)"
    if code == -signal.SIGXCPU or code == -signal.SIGKILL and "Killed" not in tail:
        return f"CPU time limit ({limits.cpu_s} s)"
    if code == -signal.SIGXFSZ or "File too large" in stderr:
        return f"file or output size limit ({limits.file_mb} MB)"
    if code in (97, 98):
        return "sandbox could not be set up"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return f"memory limit ({limits.memory_mb} MB)"
    if "BlockingIOError" in stderr or "Resource temporarily unavailable" in stderr:
        return f"process limit ({limits.processes})"
    if "Network is unreachable" in stderr or "NameResolution" in stderr or "Temporary failure in name" in stderr \
            or "gaierror" in stderr:
        return "network is not available in the sandbox"
    if "PermissionError" in stderr or "Permission denied" in stderr:
        return "write outside the sandbox directory denied"
    if code and code < 0:
        return f"killed by signal {-code}"
    return f"exit code {code}: {tail[:200]}" if tail else f"exit code {code}"


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
    def __init__(self, limits: Limits | None = None, root: str | None = None, python: str = ""):
        self.limits = limits or Limits()
        self.root = root
        self.caps = capabilities()
        self.python = python or _interpreter(self.caps["drop_to_nobody"])
        missing = [k for k, v in self.caps.items() if not v]
        if missing:
            log.warning("sandbox_layers_missing", missing=missing)

    def run_one(self, program: str, stdin: str = "") -> tuple[int | None, str, str, bool, float]:
        """Run one program confined; returns (exit code, stdout, stderr, timed out, seconds)."""
        work = Path(tempfile.mkdtemp(prefix="rlbus-sandbox-", dir=self.root))
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
                                    start_new_session=True, close_fds=True,
                                    preexec_fn=lambda: _confine(str(work), self.limits, self.caps))
            out.close()
            err.close()
            timed_out = False
            try:
                proc.wait(self.limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group: whatever it forked too
            except ProcessLookupError:
                pass
            proc.wait()
            seconds = time.monotonic() - started
            cap = self.limits.file_mb << 20
            read = lambda name: (work / name).read_bytes()[:cap].decode("utf-8", "replace")  # noqa: E731
            return proc.returncode, read("stdout.txt"), read("stderr.txt"), timed_out, seconds
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def run_tests(self, code: str, tests: list[Any]) -> SandboxResult:
        results = []
        for test in tests:
            if isinstance(test, dict):
                code_, stdout, stderr, timed_out, secs = self.run_one(code, str(test.get("input", "")))
                ok = code_ == 0 and not timed_out and stdout.strip() == str(test.get("output", "")).strip()
                reason = "" if ok else ("wrong output" if code_ == 0 and not timed_out
                                        else _reason(code_, stderr, timed_out, self.limits))
            else:
                code_, stdout, stderr, timed_out, secs = self.run_one(f"{code}\n\n{test}\n")
                ok = code_ == 0 and not timed_out
                reason = "" if ok else ("test failed: " + (stderr.strip().splitlines() or ["AssertionError"])[-1][:200]
                                        if "AssertionError" in stderr else _reason(code_, stderr, timed_out,
                                                                                  self.limits))
            results.append(TestResult(ok, reason, secs))
        return SandboxResult(sum(r.passed for r in results) / max(1, len(results)), results)

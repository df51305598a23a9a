"""How a sandboxed program's processes end, every one of them (`rlbus.reward.sandbox` runs the program).

Where the host allows a PID namespace, the child the sandbox forks forks twice into a new one
(`into_own_pid_namespace`): the namespace's first process only waits, and once the program ends the kernel ends
every process left in it, one that left the program's process group with setsid too. Where it allows none, the
child forks once and stays above the program as its child subreaper (`under_subreaper`): orphans of the
program's come up to it, not to the host's init, and it kills what is left below it when the program ends or
the parent ends the run. The parent sees the end of its child at once (`ends_by`).
"""

from __future__ import annotations

import ctypes
import os
import resource
import select
import signal
import time
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
SWEEP_S = 2.0  # what a subreaper gets to end the run, once told, before its process group is killed


def into_own_pid_namespace() -> None:
    """Fork twice into a new PID namespace: its first process (`init`) only waits, and the program is an ordinary
    process beneath it. Once the program ends, init ends and with it the namespace: the kernel kills every
    process left in it (a child that called setsid and slept would otherwise outlive the run, holding one of
    `nobody`'s processes). The process outside waits for init and ends as the program did (its status passed on
    a pipe); the parent's `wait4` counts the CPU time of all three."""
    if _libc.unshare(CLONE_NEWPID) != 0:
        os._exit(95)
    said, say = os.pipe()
    init = os.fork()
    if init:  # outside the namespace
        status = _wait_for(init, keep=said)
        told = os.read(said, 16)
        _end_as(int(told) if told else status)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # killed outside (the wall clock): the namespace ends
    program = os.fork()
    if program:  # init: reaps every orphan of the program's until the program itself ends
        os.write(say, str(_wait_for(program, keep=say)).encode())
        os._exit(0)


def under_subreaper(wake: int) -> None:
    """Without a PID namespace: fork once more, the program beneath this process, which becomes its child
    subreaper: an orphan of the program's, one that left its process group with setsid too, comes up to it
    rather than to the host's init. It waits until the program ends, or until the parent ends the run (writes to
    or closes `wake`: at the wall clock, or as the parent goes), kills what is left below it, and ends as the
    program did; the parent's `wait4` counts the CPU time of every process it reaped."""
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    program = os.fork()
    if program == 0:
        os.close(wake)
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the subreaper killed: the program goes too
        return
    # Not killed with the scoring thread: the parent's end closes `wake`, and the sweep runs before it goes.
    _libc.prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)
    _close_all_but(wake)
    status = _until_ended(program, wake)
    _sweep()
    _end_as(status)


def _until_ended(program: int, wake: int) -> int:
    """The wait status of `program`: once it ends, or, killed, once `wake` becomes readable."""
    try:
        ended = os.pidfd_open(program)
    except OSError:  # a kernel before 5.3: polled
        ended = None
    while True:
        ready = select.select([wake] + ([ended] if ended is not None else []), [], [],
                              None if ended is not None else 0.005)[0]
        if wake in ready:
            os.kill(program, signal.SIGKILL)
            return os.waitpid(program, 0)[1]
        done, status = os.waitpid(program, os.WNOHANG)
        if done:
            return status


def _sweep() -> None:
    """Kill and reap every process below this subreaper, to the last: an orphan comes up to it as its parent
    dies, so each round kills the children it has now, and it ends when it has none."""
    while True:
        for pid in _children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.wait()
        except ChildProcessError:
            return


def _children() -> list[int]:
    """This (single-threaded) process's children: from /proc's list, else by scanning every process's parent."""
    me = os.getpid()
    try:
        return [int(pid) for pid in Path(f"/proc/{me}/task/{me}/children").read_text().split()]
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN
        pass
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == me:
                found.append(int(entry))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            pass
    return found


def _close_all_but(keep: int) -> None:
    """In a process that only waits: every inherited descriptor but `keep` closed, Popen's pipe for exec errors
    among them (the parent reads that pipe to its end to learn that the program started, and must not wait for
    this process instead), and no core dump."""
    os.closerange(3, keep)
    os.closerange(keep + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _wait_for(pid: int, keep: int) -> int:
    """In a process that only waits: the wait status of its child `pid`, reaping any other child on the way."""
    _close_all_but(keep)
    while True:
        done, status = os.wait()
        if done == pid:
            return status


def _end_as(status: int) -> None:
    """End this process with the wait status `status`: the same exit code, or killed by the same signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def ends_by(pid: int, deadline: float) -> bool:
    """Whether the child `pid` ends by `deadline` (monotonic), seen at once: a pidfd becomes readable when its
    process ends (Linux 5.3; polled every 5 ms before)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        while time.monotonic() < deadline:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
            time.sleep(0.005)
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    try:
        return bool(select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0])
    finally:
        os.close(fd)

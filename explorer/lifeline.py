"""vLLM's engine processes end when their explorer ends, however it ends.

On a GPU host vLLM runs its engine core (and, with tensor parallelism, its
workers) in processes of their own. They do not watch the explorer: a
SIGKILLed explorer (the OOM killer, `kill -9`, a supervisor) would leave them
running, holding their GPU memory, and the restarted explorer could not start
its engine.

The explorer names itself the engines' owner (`RLBUS_ENGINE_OWNER_PID`, set
while vLLM starts its processes, so that they, and only they, inherit it;
`owning_engines`). vLLM runs its
general plugins in each of its processes; `register` is rlbus's: in any
process other than the owner it opens a pidfd on the owner and waits on it in
a daemon thread, and when the owner is gone it kills its own process. In the
owner it arranges the same for processes vLLM forks, which inherit the
"plugins already loaded" flag and would not run it again.

A pidfd names one process, not a number: a recycled pid cannot fool it.

vLLM's processes talk over Unix sockets that it creates in the temporary
directory (`ipc://`), and only a clean close removes them: every SIGKILLed
explorer would leave a few in /tmp for good. While it starts its engine the
explorer gives vLLM a directory of its own for them (`rlbus-vllm-PID-*`, through
`VLLM_RPC_BASE_PATH`, unless the user set that); the engine's close removes
it, an engine process whose owner is gone removes it before it ends, and
each engine started on the host removes those of owners that are gone.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

OWNER_ENV = "RLBUS_ENGINE_OWNER_PID"
RPC_ENV = "VLLM_RPC_BASE_PATH"  # where vLLM creates its ipc:// sockets
RPC_PREFIX = "rlbus-vllm-"
SOCKET_PATH_MAX = 107  # bytes in a Unix socket's path (sun_path, less its NUL)

_watching_in: int | None = None  # the pid of the process whose watch thread runs
_fork_hook_set = False


@contextmanager
def started_with(env: dict[str, str]) -> Iterator[None]:
    """Processes started inside the block get `env` in their environment; this process's is as before after it."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def owning_engines() -> Iterator[Path | None]:
    """Name this process the owner of the vLLM processes started inside the block, and give them a socket
    directory of their own; yields it (None where the user chose one with VLLM_RPC_BASE_PATH), for
    `remove_sockets` when the engine closes."""
    env = {OWNER_ENV: str(os.getpid())}
    sockets = None
    if os.environ.get(RPC_ENV) is None:
        _remove_orphaned_sockets()
        sockets = Path(tempfile.mkdtemp(prefix=f"{RPC_PREFIX}{os.getpid()}-"))
        if len(str(sockets)) + 1 + 36 <= SOCKET_PATH_MAX:  # vLLM names each socket by a uuid4
            env[RPC_ENV] = str(sockets)
        else:  # a long TMPDIR: vLLM's own place, where its paths still fit
            remove_sockets(sockets)
            sockets = None
    with started_with(env):
        register()
        try:
            yield sockets
        except BaseException:
            remove_sockets(sockets)
            raise


def remove_sockets(sockets: Path | None) -> None:
    if sockets is not None:
        shutil.rmtree(sockets, ignore_errors=True)


def _remove_orphaned_sockets() -> None:
    """The socket directories of explorers that are gone (SIGKILLed with their engine processes)."""
    for path in Path(tempfile.gettempdir()).glob(f"{RPC_PREFIX}*-*"):
        pid = path.name.removeprefix(RPC_PREFIX).partition("-")[0]
        if pid.isascii() and pid.isdigit() and not _alive(int(pid)) and path.is_dir():
            remove_sockets(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def register() -> None:
    """vLLM general plugin (entry point `vllm.general_plugins`): watch the owner from any of its processes."""
    global _fork_hook_set
    owner = _owner()
    if owner is None:
        return
    if owner == os.getpid():
        if not _fork_hook_set:
            os.register_at_fork(after_in_child=_watch_from_fork)
            _fork_hook_set = True
        return
    watch(owner)


def watch(owner: int) -> None:
    """End this process when `owner` ends (at once if it already has)."""
    global _watching_in
    if _watching_in == os.getpid():
        return
    try:
        fd = os.pidfd_open(owner)
    except ProcessLookupError:
        _end(owner)
        return
    except OSError:  # no pidfd (old kernel): fall back to watching the parent change
        fd = None
    _watching_in = os.getpid()
    threading.Thread(target=_wait, args=(owner, fd, os.getppid()), name="rlbus-owner-watch", daemon=True).start()


def _owner() -> int | None:
    try:
        return int(os.environ[OWNER_ENV])
    except (KeyError, ValueError):
        return None


def _watch_from_fork() -> None:
    owner = _owner()
    if owner is not None and owner != os.getpid():
        watch(owner)


def _wait(owner: int, fd: int | None, parent: int) -> None:
    if fd is not None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not poller.poll():
            pass
    else:
        import time

        while os.getppid() == parent:
            time.sleep(1.0)
    _end(owner)


def _end(owner: int) -> None:
    print(f"rlbus: the explorer (pid {owner}) that started this vLLM process is gone; pid {os.getpid()} exits",
          file=sys.stderr, flush=True)
    sockets = os.environ.get(RPC_ENV, "")
    if Path(sockets).name.startswith(f"{RPC_PREFIX}{owner}-"):  # the directory its owner made, not the user's
        remove_sockets(Path(sockets))
    os.kill(os.getpid(), signal.SIGKILL)

"""What every rlbus process does as a process: stop signals, the heap it starts with."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

from rlbus.common.processes import freeze_heap
from tests.conftest import REPO

# The main thread holds an Event's lock inside Event.wait for a few bytecodes at a time; a signal that arrives
# then runs its handler right there. Here the script holds that lock on purpose while the signal comes.
INSIDE_EVENT_WAIT = """
import os, signal, sys, threading, time
from rlbus.common.processes import on_stop_signals

stopped = threading.Event()
on_stop_signals(stopped.set)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    stopped.clear()
    with stopped._cond:  # where Event.wait holds its lock
        os.kill(os.getpid(), sig)
        time.sleep(0.05)  # the handler runs here
    assert stopped.wait(10), f"{sig!r} never stopped it"
print("stopped", flush=True)
"""


def test_a_stop_signal_arriving_inside_event_wait_stops_the_process_instead_of_deadlocking_it():
    """A handler that set the event itself (as the explorer's and the weight server's did) waits for ever
    for the lock its own thread holds; SIGKILL was the only way out."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(INSIDE_EVENT_WAIT)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError("deadlocked in its own signal handler") from None
    assert proc.returncode == 0 and out.strip() == "stopped", err


def test_a_frozen_heap_is_left_out_of_collections():
    made_before = [[i] for i in range(1000)]
    freeze_heap()
    tracked = {id(o) for o in gc.get_objects()}
    assert gc.get_freeze_count() >= len(made_before)
    assert not any(id(o) in tracked for o in made_before)
    gc.collect()
    assert all(o == [i] for i, o in enumerate(made_before))


def test_a_lock_is_held_by_one_process_and_goes_with_it(tmp_path):
    """What keeps a second broker off a buffer directory, and a second `rlbus up` off a run directory."""
    import pytest

    from rlbus.common.processes import Held, hold_lock

    path = tmp_path / "x.lock"
    holder = subprocess.Popen([sys.executable, "-c", f"from rlbus.common.processes import hold_lock; "
                               f"f = hold_lock({str(path)!r}); print('held', flush=True); import time; time.sleep(60)"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(Held) as exc:
            hold_lock(path)
        assert exc.value.pid == str(holder.pid)
    finally:
        holder.kill()
        holder.wait()
    mine = hold_lock(path)  # SIGKILL let it go
    assert path.read_text() == f"{os.getpid()}\n"
    mine.close()

"""What every rlbus process does as a process: stop signals (and the broker's loop they wake), the heap it
starts and ends with, its lock."""

from __future__ import annotations

import gc
import os
import select
import subprocess
import sys
import textwrap
import threading

import pytest

from rlbus.common.processes import Waker, freeze_heap
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


# The signal goes to a thread other than the main one, which blocks in a C call that the signal does not
# interrupt (a select here, a ZeroMQ poll in the broker).
ON_ANOTHER_THREAD = """
import os, select, signal, threading, time
from rlbus.common.processes import on_stop_signals

readable, writable = os.pipe()
on_stop_signals(lambda: os.write(writable, b"x"))
other = threading.Thread(target=time.sleep, args=(60,), daemon=True)
other.start()
threading.Timer(0.2, signal.pthread_kill, (other.ident, signal.SIGTERM)).start()
woken, _, _ = select.select([readable], [], [], 30)
print("stopped" if woken else "timed out", flush=True)
"""


def test_a_stop_signal_that_lands_on_another_thread_stops_a_main_thread_blocked_in_a_c_call():
    """The kernel gives a process's signal to any of its threads; Python runs the handler in the main thread at its
    next bytecode, which a thread blocked in a poll does not reach until the poll times out."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(ON_ANOTHER_THREAD)], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "stopped", out.stderr


def test_a_child_forked_after_the_stop_signals_were_set_up_cannot_stop_its_parent_through_their_pipe():
    """A child forked without exec keeps its parent's descriptors: with the parent's wakeup fd, a signal to the
    child would write into the parent's relay pipe and stop the parent."""
    script = textwrap.dedent("""
        import os, signal
        from rlbus.common.processes import on_stop_signals
        on_stop_signals(lambda: None)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if signal.set_wakeup_fd(-1) == -1 else 1)  # the wakeup fd it had: none
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "0", out.stderr


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


def test_a_waker_ends_a_poll_at_once_and_writes_nothing_once_closed():
    """What lets a stop signal end the broker's loop at once, not at its poll's next timeout."""
    waker = Waker()
    poll = select.poll()
    poll.register(waker.fileno, select.POLLIN)
    assert poll.poll(0) == []
    threading.Timer(0.05, waker.wake).start()
    assert poll.poll(60_000) == [(waker.fileno, select.POLLIN)]  # woken, not timed out
    for _ in range(100_000):  # a flood of wakes (a signal storm) never blocks: the pipe full is readable enough
        waker.wake()
    waker.close()
    readable, writable = os.pipe()  # Linux hands out the lowest free descriptors: the waker's, just closed
    try:
        os.set_blocking(readable, False)
        waker.wake()  # a late stop signal
        waker.close()
        with pytest.raises(BlockingIOError):  # empty: nothing went into the file that now has its number
            os.read(readable, 16)
    finally:
        os.close(readable)
        os.close(writable)


def test_a_collector_turned_off_at_start_is_on_again_once_the_heap_is_frozen():
    """In a process of its own, started as `rlbus explorer` starts: the collector is the whole process's."""
    script = textwrap.dedent("""
        import gc
        from rlbus.common.processes import freeze_heap
        gc.disable()
        for _ in range(100_000):  # garbage cycles enough for many automatic collections, were any to run
            a = []
            a.append(a)
        print("collector:", gc.isenabled(), gc.get_count()[0] > 100_000)
        freeze_heap()
        print("collector:", gc.isenabled(), gc.get_count()[0] < 1_000)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("collector:")]
    assert said == [["False", "True"], ["True", "True"]]  # off, none run; on again, and the cycles collected


def test_a_library_that_unfreezes_the_heap_within_heap_kept_frozen_leaves_it_frozen():
    """As an ending explorer's engine closes: vLLM's shutdown calls gc.unfreeze (in a process of its own)."""
    script = textwrap.dedent("""
        import gc
        from rlbus.common.processes import heap_kept_frozen
        kept = [[i] for i in range(1000)]
        gc.freeze()
        with heap_kept_frozen():
            gc.unfreeze()
            print("frozen:", gc.get_freeze_count() >= 1000)
        gc.unfreeze()
        print("frozen:", gc.get_freeze_count() >= 1000)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [line for line in done.stdout.splitlines() if line.startswith("frozen:")] == ["frozen: True",
                                                                                         "frozen: False"]


def test_a_process_that_loaded_triton_ends_without_its_teardown_report_and_says_all_it_had_to():
    """The teardown does not collect a frozen heap, and triton's bindings report what it holds as leaked, thirty lines
    on stderr; an rlbus process sends its teardown's output to /dev/null, after its exit handlers and its last words."""
    script = textwrap.dedent("""
        import atexit, sys
        from rlbus.common.processes import freeze_heap, quiet_teardown
        quiet_teardown()
        import torch._dynamo  # loads triton, as transformers' models do
        freeze_heap()
        atexit.register(lambda: print("said by an exit handler", file=sys.stderr))
        print("said while stopping", file=sys.stderr)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "said while stopping" in done.stderr and "said by an exit handler" in done.stderr
    assert "nanobind" not in done.stderr
    loud = subprocess.run([sys.executable, "-c", script.replace("quiet_teardown()", "")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert "nanobind: leaked" in loud.stderr, "triton's report, which the test would otherwise not see missing"


def _huge_page_mode(setting: str = "enabled") -> str | None:
    """The kernel's transparent huge page setting (`enabled`: `always`, `madvise`, `never`; `defrag`: whether a
    fault waits for the kernel to make a huge page free, `always` and `madvise` among others), None where it has
    none."""
    try:
        text = open(f"/sys/kernel/mm/transparent_hugepage/{setting}").read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


# A 64 MB tensor, every page touched (ones, not empty), and how much of the process sits in huge pages.
HUGE_TENSOR = """
import sys
from rlbus.common.processes import tensor_huge_pages
if sys.argv[1] == "asked":
    tensor_huge_pages()
import torch
tensor = torch.ones(64 << 20, dtype=torch.uint8)
for line in open("/proc/self/smaps_rollup"):
    if line.startswith("AnonHugePages:"):
        print(int(line.split()[1]) << 10)
"""


@pytest.mark.skipif(not {_huge_page_mode(), _huge_page_mode("defrag")} <= {"always", "madvise"}
                    or not os.path.exists("/proc/self/smaps_rollup"),
                    reason="the kernel grants no transparent huge pages here, or only those it has free at the fault")
def test_a_process_that_asked_for_huge_pages_keeps_its_large_tensors_in_them():
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}

    def huge_bytes(how: str) -> int:
        done = subprocess.run([sys.executable, "-c", HUGE_TENSOR, how], env=env, cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    assert huge_bytes("asked") >= 32 << 20  # most of the tensor's 64 MB (its ends need not be 2 MB aligned)
    if _huge_page_mode() == "madvise":  # only regions that ask get them: without asking, none
        assert huge_bytes("not asked") < 4 << 20


def test_asking_for_huge_pages_leaves_a_setting_of_the_environment_as_it_is(monkeypatch):
    from rlbus.common.processes import tensor_huge_pages

    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    tensor_huge_pages()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    tensor_huge_pages()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"


# `rlbus trainer` with a config it refuses: it stops at the config, after what it does first.
TRAINER_START = """
import os, sys
from rlbus.cli import app
try:
    app(["trainer", "--set", "no_such_section.key=1"], standalone_mode=False)
except Exception as exc:
    print(type(exc).__name__, os.environ.get("THP_MEM_ALLOC_ENABLE"), "torch" in sys.modules)
"""


def test_the_trainer_asks_for_huge_pages_before_torch_is_loaded():
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    done = subprocess.run([sys.executable, "-c", TRAINER_START], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["ConfigError", "1", "False"], done.stdout + done.stderr  # refused, set, no torch


@pytest.mark.parametrize("raised, said", [
    ("config", [("error", "model.path='x' is no model", False, True)]),
    ("refused", [("error", "conflict: rollout.model differs", False, True)]),
    ("crash", [("error", "AssertionError: shapes", True, False)]),
    ("bare", [("error", "AssertionError", True, False)]),  # as vLLM raised it, loading weights of other shapes
    ("offline", [("error", f"OSError: We couldn't connect to 'https://huggingface.co' {'.' * 300}", True, False)]),
    ("stopped", []),
])
def test_why_a_process_ended_is_its_last_event_in_one_line_or_with_its_traceback(raised, said):
    """A setting it cannot use and the broker's refusal are said in one line, in the log file only (the command
    prints them as its `error: ...` line); anything else with its traceback and its message whole (a model hub
    that could not be reached was said as `OSError("We couldn...on#offline-mode'.")`); a stop before the broker
    answered is no failure. The exception goes on either way (the command's exit code)."""
    from structlog.testing import capture_logs

    from rlbus.common.config import ConfigError
    from rlbus.common.connection import BrokerError, StoppedBeforeWelcome
    from rlbus.common.processes import failures_logged

    exc = {"config": ConfigError("model.path='x' is no model"), "crash": AssertionError("shapes"),
           "bare": AssertionError(), "offline": OSError(f"We couldn't connect to 'https://huggingface.co' {'.' * 300}"),
           "refused": BrokerError("conflict", "rollout.model differs"), "stopped": StoppedBeforeWelcome("")}[raised]
    with capture_logs() as logs, pytest.raises(type(exc)):
        with failures_logged("explorer_failed"):
            raise exc
    failed = [e for e in logs if e["event"] == "explorer_failed"]
    assert [(e["log_level"], e["error"], "exc_info" in e, e.get("file_only", False)) for e in failed] == said

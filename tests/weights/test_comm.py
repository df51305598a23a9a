"""`await_key`: a member's wait for a key the trainer puts in the epoch's store (NCCL's unique id), on a real
TCPStore."""

from __future__ import annotations

import datetime
import threading
import time

import pytest

from rlbus.weights.broadcast import epoch_store, serve_store
from rlbus.weights.comm import ALIVE_EVERY_S, BroadcastError, await_key


@pytest.fixture
def stores():
    """(the trainer's view of epoch 1, a member's view of it over its own connection)."""
    server, port = serve_store("127.0.0.1", 0, 30)
    trainer, _ = epoch_store("", 1, 30, store=server)
    member, _ = epoch_store(f"127.0.0.1:{port}", 1, 30)
    yield trainer, member
    del member, trainer, server


def test_the_value_is_returned_once_the_other_side_sets_it(stores):
    trainer, member = stores
    setter = threading.Timer(0.3, trainer.set, ("nccl_uid", b"uid"))
    setter.start()
    start = time.monotonic()
    assert await_key(member, "nccl_uid", 20) == b"uid"
    assert 0.25 < time.monotonic() - start < 5
    setter.join()


def test_a_key_never_set_fails_at_the_timeout_naming_it(stores):
    _, member = stores
    start = time.monotonic()
    with pytest.raises(BroadcastError, match="'nccl_uid'.*within 0.4 s"):
        await_key(member, "nccl_uid", 0.4)
    assert time.monotonic() - start < 3


def test_the_wait_is_given_up_as_soon_as_alive_raises(stores):
    _, member = stores
    calls = []

    def alive() -> None:
        calls.append(time.monotonic())
        if len(calls) == 2:
            raise BroadcastError("epoch 1: the trainer aborted it")

    start = time.monotonic()
    with pytest.raises(BroadcastError, match="aborted"):
        await_key(member, "nccl_uid", 20, alive)  # without the checks: 20 s, then a timeout
    assert len(calls) == 2
    assert time.monotonic() - start < 2 * ALIVE_EVERY_S + 2


class SliceRunsOutAsItEnds:
    """A gloo operation whose wait slice runs out ("Operation timed out!") just as the operation itself ends (the
    real operation, on a real group, is broadcast by tests/common/test_broadcast.py and tests/test_modes.py)."""

    def __init__(self, error: str | None = None):
        self.error = error
        self.completed = False

    def wait(self, timeout=None) -> bool:
        if timeout is not None and not self.completed:
            self.completed = True  # ends right after the slice's check
            raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True

    def is_completed(self) -> bool:
        return self.completed


@pytest.mark.parametrize("error", [None, "Connection closed by peer"])
def test_an_operation_that_ends_as_a_wait_slice_runs_out_has_its_own_outcome(error):
    """A broadcast whose last slice timed out just as it completed was reported failed ("gloo broadcast failed:
    Operation timed out!" after half a second of a 60 s timeout), although every member had its weights: the
    trainer logged `broadcast_aborted` for the run's last version. Its own outcome counts: done, or its error."""
    from rlbus.weights.comm import GlooComm

    work = SliceRunsOutAsItEnds(error)
    comm = object.__new__(GlooComm)
    comm.timeout = datetime.timedelta(seconds=60)
    comm.pg = type("Group", (), {"broadcast": lambda self, tensors, opts: work})()
    if error is None:
        comm.broadcast(bucket=None, alive=lambda: None)
    else:
        with pytest.raises(BroadcastError, match=f"gloo broadcast failed: {error}"):
            comm.broadcast(bucket=None, alive=lambda: None)
    assert work.completed

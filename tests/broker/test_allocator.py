"""The broker's process keeps the memory its C allocator frees (`rlbus.broker.main.keep_freed_memory`)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# Eight 2 MB buffers held at once and freed, as the frames of the PUTs in flight come and go, four times over
# after a first round: the minor page faults those four rounds took.
ROUNDS = """
import resource, sys
from rlbus.broker.main import keep_freed_memory
if sys.argv[1] == "kept":
    assert keep_freed_memory()
def round_of_puts():
    frames = [bytearray(2 << 20) for _ in range(8)]
    del frames
round_of_puts()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    round_of_puts()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's settings are glibc's")
def test_frames_freed_are_reused_without_new_page_faults():
    # glibc's defaults give the 16 MB back to the kernel at each round's end (past its 4 MB trim threshold by
    # then), so each round faults its pages in again: 4 rounds x 16 MB / 4 KB = 16,384 faults.
    assert faults("default") > 8 * 1024
    assert faults("kept") < 256

"""endpoints.json: whoever starts a broker learns the ports it bound, and never an earlier broker's."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlbus.broker import endpoints


def test_ports_are_read_only_from_the_file_the_given_process_wrote(tmp_path):
    endpoints.write(tmp_path, "127.0.0.1", 5555, 5556)  # an earlier broker's file (this process's pid)
    write = f"from rlbus.broker import endpoints; endpoints.write({str(tmp_path)!r}, '127.0.0.1', 6001, 6002)"
    later = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(1); {write}; time.sleep(30)"])
    try:
        assert endpoints.bound_ports(tmp_path, later, timeout=60) == (6001, 6002)
    finally:
        later.kill()
        later.wait()
    assert not list(tmp_path.glob("*.tmp"))


def test_a_broker_that_exits_before_serving_gives_none_and_one_that_never_serves_times_out(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert endpoints.bound_ports(tmp_path, gone, timeout=60) is None and gone.returncode == 3
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(TimeoutError, match="did not serve within 0.5 s"):
            endpoints.bound_ports(tmp_path, silent, timeout=0.5)
    finally:
        silent.kill()
        silent.wait()

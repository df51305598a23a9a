"""CurveZMQ: with keys configured, only listed clients get through."""

from __future__ import annotations

import pytest

from rlbus.common import protocol as P
from rlbus.common.client import BrokerClient
from rlbus.common.curve import make_keys


@pytest.fixture
def keys(tmp_path):
    make_keys(tmp_path / "broker", "broker")
    make_keys(tmp_path / "authorized", "alice")
    make_keys(tmp_path / "outsider", "mallory")
    return tmp_path


def test_listed_client_talks_unlisted_gets_nothing(broker_factory, keys):
    b = broker_factory(f"broker.curve_secret_key={keys}/broker/broker.key_secret",
                       f"broker.curve_authorized_dir={keys}/authorized")
    alice = BrokerClient(b.address, "tool", "alice", bus_address=b.bus, heartbeat_interval_s=0.2,
                         curve_server_key=f"{keys}/broker/broker.key",
                         curve_client_key=f"{keys}/authorized/alice.key_secret")
    mallory = BrokerClient(b.address, "tool", "mallory", heartbeat_interval_s=0.2,
                           curve_server_key=f"{keys}/broker/broker.key",
                           curve_client_key=f"{keys}/outsider/mallory.key_secret")
    plain = BrokerClient(b.address, "tool", "plain", heartbeat_interval_s=0.2)
    try:
        alice.start(10)
        assert alice.request(P.STATUS, timeout=5).command == P.STATUS
        for outsider in (mallory, plain):
            with pytest.raises(TimeoutError):
                outsider.start(1.5)
    finally:
        for c in (alice, mallory, plain):
            c.close(bye=False, timeout=1)


def test_a_key_file_that_is_missing_or_no_key_is_a_config_error_naming_its_setting(keys, tmp_path):
    """Said where the client is made, not by its I/O thread dying while the caller waits for a WELCOME."""
    from rlbus.common.config import ConfigError

    (tmp_path / "text").write_text("not a key")
    cases = {("nope.key", "authorized/alice.key_secret"): "broker.curve_server_key='.*nope.key': no such key file",
             ("text", "authorized/alice.key_secret"): "broker.curve_server_key='.*text': not a CurveZMQ key file",
             ("broker/broker.key", "authorized/alice.key"): "broker.curve_client_key='.*alice.key' holds no secret",
             ("broker/broker.key", ""): r"needs this client's key pair \(broker.curve_client_key\)"}
    for (server, client), error in cases.items():
        with pytest.raises(ConfigError, match=error):
            BrokerClient("tcp://127.0.0.1:1", "tool", curve_server_key=str(keys / server),
                         curve_client_key=str(keys / client) if client else "")


def test_rlbus_keys_never_replaces_a_pair_unasked(tmp_path):
    """Every peer holds the broker's public key: a second `rlbus keys DIR broker` would lock them all out."""
    import subprocess
    import sys

    def keys(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rlbus.cli", "keys", str(tmp_path), "broker", *extra],
                              capture_output=True, text=True, timeout=60)

    assert keys().returncode == 0
    first = (tmp_path / "broker.key").read_bytes(), (tmp_path / "broker.key_secret").read_bytes()
    again = keys()
    assert again.returncode == 1
    assert again.stderr == f"error: {tmp_path / 'broker.key'} exists; a key pair is never replaced unasked (--force)\n"
    assert ((tmp_path / "broker.key").read_bytes(), (tmp_path / "broker.key_secret").read_bytes()) == first
    assert keys("--force").returncode == 0 and (tmp_path / "broker.key").read_bytes() != first[0]


def test_rlbus_keys_writes_the_secret_key_for_its_owner_only_and_refuses_a_name_or_place_it_cannot_use(tmp_path):
    """A name with a slash, or a directory under a file, was a traceback; an empty name wrote `.key`."""
    import stat
    import subprocess
    import sys

    def keys(directory, name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rlbus.cli", "keys", str(directory), name],
                              capture_output=True, text=True, timeout=60)

    assert keys(tmp_path, "explorer-1").returncode == 0
    assert stat.S_IMODE((tmp_path / "explorer-1.key_secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "explorer-1.key").stat().st_mode) == 0o644
    (tmp_path / "file").write_text("")
    for directory, name, said in ((tmp_path, "a/b", "is not a file name"), (tmp_path, "", "is not a file name"),
                                  (tmp_path / "file" / "keys", "k", "Not a directory")):
        done = keys(directory, name)
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and said in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["explorer-1.key", "explorer-1.key_secret", "file"]

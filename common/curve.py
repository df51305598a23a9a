"""CurveZMQ keys: making them, and turning them on for the broker and clients.

`rlbus keys DIR NAME` writes NAME.key (public) and NAME.key_secret. The broker
loads its secret key and accepts only clients whose public keys sit in its
authorized directory; clients load their own pair and the broker's public
key. Without keys configured, everything runs in the clear (fine on one host
or a private network).
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from rlbus.common.config import ConfigError


def make_keys(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write a new key pair; returns (public key file, secret key file). ValueError for a name that is no plain
    file name, OSError for a directory that cannot be written to."""
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"key name {name!r} is not a file name (e.g. broker or explorer-1)")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    umask = os.umask(0o077)  # the secret key is readable by its owner only from the moment it exists
    try:
        public, secret = zmq.auth.create_certificates(d, name)
    finally:
        os.umask(umask)
    Path(public).chmod(0o644)
    return Path(public), Path(secret)


def _load(path: str | Path, secret: bool, setting: str) -> tuple[bytes, bytes | None]:
    """A key file's (public key, secret key); ConfigError naming `setting` for a file that is missing, is not a
    key file, or lacks the secret key asked for."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{setting}={str(path)!r}: no such key file (make a pair with `rlbus keys DIR NAME`)")
    try:
        public, secret_key = zmq.auth.load_certificate(p)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{setting}={str(path)!r}: not a CurveZMQ key file ({exc})") from None
    if secret and secret_key is None:
        raise ConfigError(f"{setting}={str(path)!r} holds no secret key; give the NAME.key_secret file")
    return public, secret_key


def load_server_auth(ctx: zmq.Context, secret_file: str, authorized_dir: str, sockets: list[zmq.Socket],
                     settings: tuple[str, str] = ("broker.curve_secret_key", "broker.curve_authorized_dir"),
                     ) -> ThreadAuthenticator:
    """Make `sockets` CURVE servers that admit only keys found in `authorized_dir`; `settings` name the key file
    and the directory in errors."""
    if not authorized_dir or not Path(authorized_dir).is_dir():
        raise ConfigError(f"{settings[1]}={authorized_dir!r} must be a directory of client public keys")
    public, secret = _load(secret_file, True, settings[0])
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(authorized_dir))
    for sock in sockets:
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_server = True
    return auth


def client_keys(server_public_file: str, client_secret_file: str) -> tuple[bytes, bytes, bytes]:
    """The broker's public key and this client's key pair, read from the files the config names (at once, so a
    missing file is a ConfigError where the client is made, not in its I/O thread)."""
    server_public, _ = _load(server_public_file, False, "broker.curve_server_key")
    return (server_public, *_own_pair(client_secret_file))


def _own_pair(client_secret_file: str) -> tuple[bytes, bytes]:
    if not client_secret_file:
        raise ConfigError("a CURVE server needs this client's key pair (broker.curve_client_key)")
    public, secret = _load(client_secret_file, True, "broker.curve_client_key")
    assert secret is not None
    return public, secret


def use_keys(sock: zmq.Socket, server_public: bytes, public: bytes, secret: bytes) -> None:
    """Make `sock` a CURVE client of the server whose public key is given, with this client's pair."""
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def configure_client_keys(sock: zmq.Socket, server_public: bytes, client_secret_file: str) -> None:
    """Make `sock` a CURVE client of the server whose public key (Z85) is given."""
    use_keys(sock, server_public, *_own_pair(client_secret_file))

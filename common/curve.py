"""CurveZMQ keys: making them, and turning them on for the broker and clients.

`rlbus keys DIR NAME` writes NAME.key (public) and NAME.key_secret. The broker
loads its secret key and accepts only clients whose public keys sit in its
authorized directory; clients load their own pair and the broker's public
key. Without keys configured, everything runs in the clear (fine on one host
or a private network).
"""

from __future__ import annotations

from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


def make_keys(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write a new key pair; returns (public key file, secret key file)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(d, name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def _load(path: str | Path, secret: bool) -> tuple[bytes, bytes | None]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"CurveZMQ key file {p} does not exist (make one with `rlbus keys`)")
    public, secret_key = zmq.auth.load_certificate(p)
    if secret and secret_key is None:
        raise ValueError(f"{p} holds no secret key; give the NAME.key_secret file")
    return public, secret_key


def load_server_auth(ctx: zmq.Context, secret_file: str, authorized_dir: str,
                     sockets: list[zmq.Socket]) -> ThreadAuthenticator:
    """Make `sockets` CURVE servers that admit only keys found in `authorized_dir`."""
    if not authorized_dir or not Path(authorized_dir).is_dir():
        raise ValueError(f"broker.curve_authorized_dir={authorized_dir!r} must be a directory of client public keys")
    public, secret = _load(secret_file, secret=True)
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(authorized_dir))
    for sock in sockets:
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_server = True
    return auth


def configure_client(sock: zmq.Socket, server_public_file: str, client_secret_file: str) -> None:
    """Make `sock` a CURVE client of the broker whose public key file is given."""
    server_public, _ = _load(server_public_file, secret=False)
    configure_client_keys(sock, server_public, client_secret_file)


def configure_client_keys(sock: zmq.Socket, server_public: bytes, client_secret_file: str) -> None:
    """Make `sock` a CURVE client of the server whose public key (Z85) is given."""
    if not client_secret_file:
        raise ValueError("a CURVE server needs this client's key pair (broker.curve_client_key)")
    public, secret = _load(client_secret_file, secret=True)
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret

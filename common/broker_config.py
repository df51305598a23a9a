"""The broker's sections of a run's configuration: its buffer and its sockets (`config.py` assembles them with the
others, from `sections.py`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from rlbus.common.protocol import EVERY_INTERFACE, tcp
from rlbus.common.sections import Endpoint, Host, Section, checked_host


class BufferConfig(Section):
    dir: str = ""
    """Data directory of the durable buffer; empty means `<run_dir>/buffer`."""
    capacity: int = Field(20000, ge=1)
    """Trajectories held and not yet committed; a full buffer slows explorers, it never drops data."""
    fsync: Annotated[Literal["group", "off"], BeforeValidator(lambda v: "off" if v is False else v)] = "group"
    """group: fdatasync payloads and commit metadata before every ACK (survives power loss); off: survive process crashes only."""
    cache_mb: int = Field(512, ge=0)
    """Payloads kept in memory until trained on, up to this many MiB; beyond it they are read back from disk."""
    segment_bytes: int = Field(256 << 20, ge=1 << 20)
    """Roll over to a new payload segment file after this many bytes."""


class BrokerConfig(Section):
    host: Host = "127.0.0.1"
    """Address the broker binds: a name, an IPv4 or an IPv6 address (0.0.0.0 to serve other hosts; :: for IPv6 too)."""
    port: int = Field(5555, ge=0, le=65535)
    """Request (ROUTER) port; 0 picks a free port (written to endpoints.json in the buffer directory, and passed
    on to the others by `rlbus up`)."""
    pub_port: int = Field(5556, ge=0, le=65535)
    """Weight-version bus (PUB) port; 0 picks a free port, as for `port`."""
    heartbeat_interval_s: float = Field(1.0, gt=0)
    """Seconds between heartbeats."""
    liveness: int = Field(5, ge=2)
    """Heartbeats missed before a peer is dropped (and its leases re-issued). Time in which the broker itself
    did not read (a starved or stopped process, logged as `broker_stalled`) does not count."""
    lease_timeout_s: float = Field(600.0, gt=0)
    """A task lease not completed in this time is issued to someone else."""
    republish_interval_s: float = Field(2.0, gt=0)
    """The weight state is put on the bus again this often, for late subscribers."""
    max_message_bytes: int = Field(64 << 20, ge=1 << 16)
    """Largest message accepted; larger ones get ERROR too_large."""
    max_payload_bytes: int = Field(16 << 20, ge=1 << 10)
    """Largest single trajectory payload."""
    curve_secret_key: str = ""
    """Path of the broker's CurveZMQ secret key file; set it to require encryption and client keys."""
    curve_authorized_dir: str = ""
    """Directory of client public key files the broker accepts (with curve_secret_key)."""
    address: Endpoint = "tcp://127.0.0.1:5555"
    """Where clients reach the broker's request socket. Left unset, it is `tcp://HOST:PORT` of `host` and `port`
    (the loopback for a broker on every interface), so one config with only a port serves a broker and its peers."""
    pub_address: Endpoint = ""
    """Where clients reach the bus; empty means the request address with pub_port."""
    curve_server_key: str = ""
    """Client side: path of the broker's public key file."""
    curve_client_key: str = ""
    """Client side: path of this client's secret key file (its public key must be listed at the broker)."""

    @model_validator(mode="before")
    @classmethod
    def _dial_what_is_bound(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "address" in data:
            return data
        port, host = data.get("port", 5555), data.get("host", "127.0.0.1")
        if isinstance(port, int) and not isinstance(port, bool) and 0 < port <= 65535 and isinstance(host, str):
            try:
                data = {**data, "address": dialled(checked_host(host), port)}
            except ValueError:
                pass  # the host's own check names it
        return data


def dialled(host: str, port: int) -> str:
    """The address a peer on this host dials for a socket bound to `host` and `port`."""
    return tcp("127.0.0.1" if host in EVERY_INTERFACE else host, port)

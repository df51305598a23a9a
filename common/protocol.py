"""The rlbus wire protocol, version 1: frame layout, commands, field checks.

docs/protocol.md is the contract this module implements. Every peer builds
and parses messages through `encode` and `decode`, so a frame that does not
parse raises `ProtocolError` with a code the broker can send back in an ERROR
reply. Headers are msgpack maps; payloads are raw binary frames that the
broker stores without decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack

PROTOCOL = b"rlbus/1"

# Commands peers send to the broker.
HELLO = "HELLO"
HEARTBEAT = "HEARTBEAT"
BYE = "BYE"
LEASE = "LEASE"
PUT = "PUT"
FETCH = "FETCH"
COMMIT = "COMMIT"
PUBLISH = "PUBLISH"
STATUS = "STATUS"
EVAL = "EVAL"
RESULT = "RESULT"
# Replies and broker-initiated messages.
WELCOME = "WELCOME"
TASKS = "TASKS"
WAIT = "WAIT"
DONE = "DONE"
ACK = "ACK"
CREDIT = "CREDIT"
BATCH = "BATCH"
EMPTY = "EMPTY"
OK = "OK"
ERROR = "ERROR"

REQUESTS = frozenset({HELLO, HEARTBEAT, BYE, LEASE, PUT, FETCH, COMMIT, PUBLISH, STATUS, EVAL, RESULT})
REPLIES = frozenset({WELCOME, TASKS, WAIT, DONE, ACK, CREDIT, BATCH, EMPTY, OK, ERROR, STATUS, HEARTBEAT, RESULT})
# Messages the broker sends on its own to a peer (not replies): the client hands them to the peer's code.
UNSOLICITED = frozenset({EVAL})
ROLES = frozenset({"explorer", "trainer", "reward", "tool"})

# Bus topics.
TOPIC_WEIGHTS = b"weights"

# Limits that do not depend on configuration.
MAX_HEADER_BYTES = 1 << 20
MAX_FRAMES = 4096
MAX_ID_CHARS = 128


class ProtocolError(Exception):
    """A message that does not follow the protocol; `code` goes into ERROR."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True)
class Message:
    command: str
    header: dict[str, Any]
    payloads: list[bytes] = field(default_factory=list)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


def encode(command: str, header: dict[str, Any] | None = None, payloads: list[bytes] | None = None) -> list[bytes]:
    """Frames of one message: protocol tag, command, header, payloads."""
    return [PROTOCOL, command.encode("ascii"), pack(header or {}), *(payloads or [])]


def decode(frames: list[bytes], max_message_bytes: int | None = None) -> Message:
    """Parse the frames of one message (without the routing identity).

    Raises ProtocolError for anything that is not a well-formed message of
    this protocol version; the caller answers with ERROR and carries on.
    """
    if len(frames) < 3:
        raise ProtocolError("malformed", f"a message has at least 3 frames (protocol, command, header); got {len(frames)}")
    if frames[0] != PROTOCOL:
        tag = bytes(frames[0][:32]).decode("ascii", "replace")
        raise ProtocolError("bad_version", f"protocol tag {tag!r} is not supported; this peer speaks {PROTOCOL.decode()}")
    if max_message_bytes is not None:
        total = sum(len(f) for f in frames)
        if total > max_message_bytes:
            raise ProtocolError("too_large", f"message of {total} bytes exceeds the limit of {max_message_bytes}")
    if len(frames) - 3 > MAX_FRAMES:
        raise ProtocolError("too_large", f"{len(frames) - 3} payload frames exceed the limit of {MAX_FRAMES}")
    try:
        command = bytes(frames[1]).decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("malformed", "command frame is not ASCII") from None
    if len(frames[2]) > MAX_HEADER_BYTES:
        raise ProtocolError("too_large", f"header of {len(frames[2])} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    try:
        header = unpack(frames[2])
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError("malformed", f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("malformed", f"header must be a msgpack map, got {type(header).__name__}")
    return Message(command, header, list(frames[3:]))


# ---- field checks ---------------------------------------------------------

_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "map": (dict,),
    "list": (list,),
}

# command -> {field: (type name, required)}
SCHEMAS: dict[str, dict[str, tuple[str, bool]]] = {
    HELLO: {"req": ("int", False), "role": ("str", True), "name": ("str", True), "pid": ("int", False),
            "host": ("str", False), "policy_version": ("int", False), "capabilities": ("map", False)},
    HEARTBEAT: {"policy_version": ("int", False)},
    BYE: {"req": ("int", False)},
    LEASE: {"req": ("int", False), "max_tasks": ("int", True), "policy_version": ("int", True)},
    PUT: {"req": ("int", False), "trajectories": ("list", True)},
    FETCH: {"req": ("int", False), "step": ("int", True), "max_groups": ("int", True), "min_groups": ("int", False),
            "batch_index": ("int", False), "skip_zero_spread": ("bool", False), "wait_ms": ("int", False)},
    COMMIT: {"req": ("int", False), "step": ("int", True)},
    PUBLISH: {"req": ("int", False), "version": ("int", True), "method": ("str", True), "location": ("str", True),
              "digest": ("str", True), "step": ("int", False), "broadcast": ("map", False)},
    STATUS: {"req": ("int", False)},
    EVAL: {"req": ("int", False), "service": ("str", True), "items": ("list", True)},
    RESULT: {"job": ("int", True), "results": ("list", True)},
}

TRAJECTORY_SCHEMA: dict[str, tuple[str, bool]] = {
    "id": ("str", True), "group_id": ("str", True), "task_id": ("str", True), "group_size": ("int", True),
    "batch_index": ("int", True), "policy_version": ("int", True), "reward": ("float", True),
    "n_tokens": ("int", True), "payload_bytes": ("int", True), "info": ("map", False),
}


def _check_fields(where: str, data: dict, schema: dict[str, tuple[str, bool]]) -> None:
    for name, (kind, required) in schema.items():
        value = data.get(name)
        if value is None:
            if required:
                raise ProtocolError("bad_field", f"{where}: field {name!r} is required ({kind})")
            continue
        # bool is a subclass of int: keep the two apart.
        if not isinstance(value, _TYPES[kind]) or (kind in ("int", "float") and isinstance(value, bool)):
            raise ProtocolError("bad_field", f"{where}: field {name!r} must be {kind}, got {type(value).__name__} {value!r:.40}")
        if kind == "int" and value < 0:
            raise ProtocolError("bad_field", f"{where}: field {name!r} must be >= 0, got {value}")
        if kind == "float" and not math.isfinite(value):
            raise ProtocolError("bad_field", f"{where}: field {name!r} must be finite, got {value}")
        if kind == "str" and len(value) > MAX_ID_CHARS and name in ("id", "group_id", "task_id", "name"):
            raise ProtocolError("bad_field", f"{where}: field {name!r} is longer than {MAX_ID_CHARS} characters")


def _trajectory_ok(m: Any) -> bool:
    """Fast check of one PUT entry against TRAJECTORY_SCHEMA (the hot path of the broker)."""
    if type(m) is not dict:
        return False
    i, g, t, r = m.get("id"), m.get("group_id"), m.get("task_id"), m.get("reward")
    info = m.get("info")
    return (type(i) is str and len(i) <= MAX_ID_CHARS and type(g) is str and len(g) <= MAX_ID_CHARS
            and type(t) is str and len(t) <= MAX_ID_CHARS
            and type(m.get("group_size")) is int and m["group_size"] >= 1
            and type(m.get("batch_index")) is int and m["batch_index"] >= 0
            and type(m.get("policy_version")) is int and m["policy_version"] >= 0
            and type(m.get("n_tokens")) is int and m["n_tokens"] >= 0
            and type(m.get("payload_bytes")) is int and m["payload_bytes"] >= 0
            and type(r) in (float, int) and math.isfinite(r)
            and (info is None or type(info) is dict))


def validate(msg: Message) -> None:
    """Check a request's fields against its schema; raise ProtocolError if wrong."""
    schema = SCHEMAS.get(msg.command)
    if schema is None:
        raise ProtocolError("unknown_command", f"unknown command {msg.command!r:.40}; known: {', '.join(sorted(SCHEMAS))}")
    _check_fields(msg.command, msg.header, schema)
    if msg.command == HELLO and msg.header["role"] not in ROLES:
        raise ProtocolError("bad_field", f"HELLO: role {msg.header['role']!r:.40} is not one of {sorted(ROLES)}")
    if msg.command == PUT:
        trajectories = msg.header["trajectories"]
        if len(msg.payloads) != 1:
            raise ProtocolError("bad_field", f"PUT carries exactly one payload frame, got {len(msg.payloads)}")
        for i, meta in enumerate(trajectories):
            if not _trajectory_ok(meta):
                # Slow path only to say precisely what is wrong.
                if not isinstance(meta, dict):
                    raise ProtocolError("bad_field", f"PUT: trajectories[{i}] must be a map")
                _check_fields(f"PUT trajectories[{i}]", meta, TRAJECTORY_SCHEMA)
                raise ProtocolError("bad_field", f"PUT trajectories[{i}]: group_size must be >= 1")
        total = sum(m["payload_bytes"] for m in trajectories)
        if total != len(msg.payloads[0]):
            raise ProtocolError("bad_field", f"PUT: payload_bytes add up to {total} but the payload frame "
                                             f"has {len(msg.payloads[0])} bytes")
    elif msg.header.get("max_tasks") == 0 or msg.header.get("max_groups") == 0:
        raise ProtocolError("bad_field", f"{msg.command}: asking for zero items")


def join_payloads(metas: list[dict[str, Any]], payloads: list[bytes]) -> bytes:
    """The one payload frame of a PUT or BATCH; sets each meta's `payload_bytes`."""
    for meta, payload in zip(metas, payloads, strict=True):
        meta["payload_bytes"] = len(payload)
    return b"".join(payloads)


def split_payloads(metas: list[dict[str, Any]], frames: bytes | memoryview | list) -> list[memoryview]:
    """Inverse of join_payloads: one view per trajectory.

    `frames` is one payload frame or the list of a message's payload frames
    (a BATCH may send its payloads in several frames; their concatenation is
    what counts).
    """
    if isinstance(frames, list):
        frames = frames[0] if len(frames) == 1 else b"".join(frames)
    view = memoryview(frames)
    out, offset = [], 0
    for meta in metas:
        n = meta["payload_bytes"]
        out.append(view[offset:offset + n])
        offset += n
    if offset != len(view):
        raise ProtocolError("bad_field", f"payload_bytes add up to {offset}, frame has {len(view)} bytes")
    return out


def error(code: str, message: str, req: int | None = None) -> list[bytes]:
    header: dict[str, Any] = {"code": code, "message": message}
    if req is not None:
        header["req"] = req
    return encode(ERROR, header)

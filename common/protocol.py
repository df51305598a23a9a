"""The rlbus wire protocol, version 1: frame layout, commands, field checks.

docs/protocol.md is the contract this module implements. Every peer builds
and parses messages through `encode` and `decode`, so a frame that does not
parse raises `ProtocolError` with a code the broker can send back in an ERROR
reply. Headers are msgpack maps; payloads are raw binary frames that the
broker stores without decoding.
"""

from __future__ import annotations

import math
import reprlib
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
MAX_DEPTH = 16  # maps and lists inside a header; what the broker stores it re-emits a few levels deeper
MAX_INT = (1 << 53) - 1  # integers are unsigned and exact in a double, in JSON and in SQLite
# Replies (a BATCH of many groups) may be larger than a request header.
MAX_REPLY_HEADER_BYTES = 256 << 20

_brief = reprlib.Repr()
_brief.maxlevel, _brief.maxstring, _brief.maxother, _brief.maxlist, _brief.maxdict = 2, 40, 40, 4, 4


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


def brief(value: Any) -> str:
    """A short repr for error messages: bounded in length and depth whatever a peer sent."""
    return _brief.repr(value)


def too_deep(obj: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether maps and lists nest deeper than `limit` (iteratively: no recursion a peer can exhaust)."""
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if type(item) is dict else item
        stack.extend((c, depth + 1) for c in children if type(c) in (dict, list))
    return False


def decode(frames: list[bytes], max_message_bytes: int | None = None,
           max_header_bytes: int = MAX_HEADER_BYTES) -> Message:
    """Parse the frames of one message (without the routing identity).

    Raises ProtocolError for anything that is not a well-formed message of
    this protocol version; the caller answers with ERROR and carries on.
    Checks run in the order docs/protocol.md gives (*Errors*), so the code a
    bad message gets does not depend on the peer.
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
    if len(frames[2]) > max_header_bytes:
        raise ProtocolError("too_large", f"header of {len(frames[2])} bytes exceeds the limit of {max_header_bytes}")
    try:
        header = unpack(frames[2])
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError("malformed", f"header is not valid msgpack: {str(exc)[:200]}") from None
    if not isinstance(header, dict):
        raise ProtocolError("malformed", f"header must be a msgpack map, got {type(header).__name__}")
    if too_deep(header):
        raise ProtocolError("malformed", f"header nests maps and lists deeper than {MAX_DEPTH} levels")
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
            "host": ("str", False), "policy_version": ("int", False), "capabilities": ("map", False),
            "session": ("str", False), "rollout": ("map", False)},
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

# Maps inside requests whose fields the broker reads or passes on to other peers.
BROADCAST_SCHEMA: dict[str, tuple[str, bool]] = {
    "epoch": ("int", True), "backend": ("str", True), "address": ("str", True), "world": ("int", True),
    "ranks": ("map", True), "version": ("int", True), "digest": ("str", True), "timeout_s": ("float", True),
}
EVAL_ITEM_SCHEMA: dict[str, tuple[str, bool]] = {"task": ("map", False), "text": ("str", True),
                                                 "token_ids": ("list", False)}
# The run-wide sampling contract: WELCOME carries all of it; an explorer's HELLO may carry the fields it was
# given, and the broker refuses it if one differs from the run's.
ROLLOUT_SCHEMA: dict[str, tuple[str, bool]] = {
    "temperature": ("float", False), "top_p": ("float", False), "max_tokens": ("int", False),
    "dtype": ("str", False), "repeat": ("int", False), "seed": ("int", False),
}
# HELLO capabilities the broker reads; any other key is kept as it came (within MAX_DEPTH).
CAPABILITY_LISTS = ("services", "sync_methods", "broadcast_backends")

TRAJECTORY_SCHEMA: dict[str, tuple[str, bool]] = {
    "id": ("str", True), "group_id": ("str", True), "task_id": ("str", True), "group_size": ("int", True),
    "batch_index": ("int", True), "policy_version": ("int", True), "reward": ("float", True),
    "n_tokens": ("int", True), "payload_bytes": ("int", True), "info": ("map", False),
}


def _check_fields(where: str, data: dict, schema: dict[str, tuple[str, bool]]) -> None:
    """Type and range of every field in `schema`. A field may be left out when optional; nil is never
    a value (it is a type error, not "absent"), so what the broker stores it can always re-emit."""
    for name, (kind, required) in schema.items():
        if name not in data:
            if required:
                raise ProtocolError("bad_field", f"{where}: field {name!r} is required ({kind})")
            continue
        value = data[name]
        # bool is a subclass of int: keep the two apart.
        if not isinstance(value, _TYPES[kind]) or (kind in ("int", "float") and isinstance(value, bool)):
            got = "nil" if value is None else f"{type(value).__name__} {brief(value)}"
            raise ProtocolError("bad_field", f"{where}: field {name!r} must be {kind}, got {got}"
                                + ("; leave the field out instead of sending nil" if value is None else ""))
        if kind == "int" and not 0 <= value <= MAX_INT:
            raise ProtocolError("bad_field", f"{where}: field {name!r} must be between 0 and 2^53 - 1, "
                                             f"got {brief(value)}")
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
            and type(m.get("group_size")) is int and 1 <= m["group_size"] <= MAX_INT
            and type(m.get("batch_index")) is int and 0 <= m["batch_index"] <= MAX_INT
            and type(m.get("policy_version")) is int and 0 <= m["policy_version"] <= MAX_INT
            and type(m.get("n_tokens")) is int and 0 <= m["n_tokens"] <= MAX_INT
            and type(m.get("payload_bytes")) is int and 0 <= m["payload_bytes"] <= MAX_INT
            and type(r) in (float, int) and math.isfinite(r)
            and ("info" not in m or type(info) is dict))


def validate(msg: Message) -> None:
    """Check a request's fields against its schema; raise ProtocolError if wrong."""
    schema = SCHEMAS.get(msg.command)
    if schema is None:
        raise ProtocolError("unknown_command", f"unknown command {brief(msg.command)}; known: {', '.join(sorted(SCHEMAS))}")
    _check_fields(msg.command, msg.header, schema)
    if msg.command == HELLO:
        _check_hello(msg.header)
    elif msg.command == PUBLISH and "broadcast" in msg.header:
        _check_broadcast(msg.header["broadcast"])
    elif msg.command == EVAL:
        for i, item in enumerate(msg.header["items"]):
            if type(item) is not dict:
                raise ProtocolError("bad_field", f"EVAL: items[{i}] must be a map")
            _check_fields(f"EVAL items[{i}]", item, EVAL_ITEM_SCHEMA)
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


def _check_hello(h: dict[str, Any]) -> None:
    if h["role"] not in ROLES:
        raise ProtocolError("bad_field", f"HELLO: role {brief(h['role'])} is not one of {sorted(ROLES)}")
    if "rollout" in h:
        _check_fields("HELLO rollout", h["rollout"], ROLLOUT_SCHEMA)
    for key in CAPABILITY_LISTS:
        value = h.get("capabilities", {}).get(key, [])
        if type(value) is not list or not all(type(v) is str and len(v) <= MAX_ID_CHARS for v in value):
            raise ProtocolError("bad_field", f"HELLO: capabilities.{key} must be a list of names "
                                             f"(strings of at most {MAX_ID_CHARS} characters), got {brief(value)}")


def _check_broadcast(b: dict[str, Any]) -> None:
    _check_fields("PUBLISH broadcast", b, BROADCAST_SCHEMA)
    ranks = b["ranks"]
    if not all(type(r) is int and not isinstance(r, bool) and 1 <= r < b["world"] for r in ranks.values()):
        raise ProtocolError("bad_field", f"PUBLISH broadcast: ranks must map explorer names to ranks "
                                         f"1..world-1, got {brief(ranks)}")


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

"""The rlbus wire protocol, version 1: frame layout, commands, field checks.

docs/protocol.md is the contract this module implements. Every peer builds
and parses messages through `encode` and `decode`, so a frame that does not
parse raises `ProtocolError` with a code the broker can send back in an ERROR
reply. Headers are msgpack maps; payloads are raw binary frames that the
broker stores without decoding.
"""

from __future__ import annotations

import itertools
import re
import reprlib
from dataclasses import dataclass, field
from typing import Any

import msgpack
import msgspec
from msgspec import Struct

from rlbus.common import messages
from rlbus.common.messages import MAX_ID_CHARS, MAX_INT  # noqa: F401  (part of this module's API)

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
SWAP = "SWAP"
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

REQUESTS = frozenset({HELLO, HEARTBEAT, BYE, LEASE, PUT, FETCH, COMMIT, PUBLISH, STATUS, EVAL, RESULT, SWAP})
REPLIES = frozenset({WELCOME, TASKS, WAIT, DONE, ACK, CREDIT, BATCH, EMPTY, OK, ERROR, STATUS, HEARTBEAT, RESULT})
# Messages the broker sends on its own to a peer (not replies): the client hands them to the peer's code.
UNSOLICITED = frozenset({EVAL})
ROLES = frozenset({"explorer", "trainer", "reward", "tool"})

# Bus topics.
TOPIC_WEIGHTS = b"weights"

# Limits that do not depend on configuration.
MAX_HEADER_BYTES = 1 << 20
MAX_FRAMES = 4096
MAX_DEPTH = 16  # maps and lists inside a header; what the broker stores it re-emits a few levels deeper
# Replies (a BATCH of many groups) may be larger than a request header, and nest deeper: the broker re-emits
# what it stored up to two levels below where it came (a trajectory's map in BATCH, capabilities in STATUS).
MAX_REPLY_HEADER_BYTES = 256 << 20
MAX_REPLY_DEPTH = MAX_DEPTH + 4

# A ZeroMQ TCP endpoint as peers dial it: tcp://HOST:PORT, HOST a name, an IPv4 address or [IPv6].
ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s/:\[\]]+):(\d{1,5})")


def dialable(endpoint: str) -> bool:
    """Whether `endpoint` is tcp://HOST:PORT that a peer can dial: HOST a name, an IPv4 address or [IPv6], PORT
    1 to 65535."""
    match = ENDPOINT.fullmatch(endpoint)
    return match is not None and 1 <= int(match[2]) <= 65535
# Hosts that mean every interface of the machine, for a socket that binds.
EVERY_INTERFACE = ("0.0.0.0", "*", "", "::")


def bracketed(host: str) -> str:
    """`host` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def tcp(host: str, port: int | str) -> str:
    """The ZeroMQ endpoint of `host` and `port`: an IPv6 address in brackets, as ZeroMQ reads it."""
    return f"tcp://{bracketed(host)}:{port}"


def allow_ipv6(sock: Any, endpoint: str) -> None:
    """Let `sock` bind or dial `endpoint` if it is an IPv6 address: ZeroMQ takes one only on a socket told so.
    A name or an IPv4 address leaves it off (a name known by both families would be dialled on its IPv6
    address, where a broker on an IPv4 address is not)."""
    sock.ipv6 = endpoint.startswith("tcp://[")


def bind_tcp(sock: Any, host: str, port: int) -> int:
    """Bind `sock` on `host` and `port` (0: a free one), an IPv6 host too; returns the port. zmq.ZMQError if the
    address cannot be bound."""
    endpoint = tcp(host, port or "*")
    allow_ipv6(sock, endpoint)
    if port == 0:
        return sock.bind_to_random_port(endpoint.rpartition(":")[0])
    sock.bind(endpoint)
    return port


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
    typed: Struct | None = None  # the header's Struct, when decoding made it (`validate` makes it otherwise)


_encoder = msgspec.msgpack.Encoder()


def pack(obj: Any) -> bytes:
    """msgpack bytes of `obj` (strings as str, bytes as bin): what msgpack.packb(use_bin_type=True) writes,
    at a third of its cost (a BATCH header of 512 trajectories: 100 µs against 310)."""
    return _encoder.encode(obj)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


def request_id(header: bytes) -> int | None:
    """The `req` of a header that may be refused (too large, too deep, of a bad field), or None where it has
    none that can be read: only the top-level keys are decoded, every other value is skipped unbuilt."""
    try:
        reader = msgpack.Unpacker(raw=False, max_buffer_size=max(len(header), 1))
        reader.feed(header)
        for _ in range(reader.read_map_header()):
            if reader.unpack() == "req":
                req = reader.unpack()
                return req if type(req) is int and 0 <= req <= MAX_INT else None
            reader.skip()
    except Exception:  # not msgpack, not a map, cut short, nested past the decoder's stack
        return None
    return None


def encode(command: str, header: dict[str, Any] | None = None, payloads: list[bytes] | None = None) -> list[bytes]:
    """Frames of one message: protocol tag, command, header, payloads."""
    return [PROTOCOL, command.encode("ascii"), pack(header or {}), *(payloads or [])]


def brief(value: Any) -> str:
    """A short repr for error messages: bounded in length and depth whatever a peer sent."""
    return _brief.repr(value)


_NESTING = frozenset((dict, list))
_SCALARS = frozenset((str, int, float, bool, bytes, type(None)))  # what msgpack decodes but maps, lists, extensions
_VALUES = _SCALARS | _NESTING


def too_deep(obj: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether maps and lists nest deeper than `limit` (level by level: no recursion a peer can exhaust).

    A container whose values are all scalars, like each trajectory of a PUT, is passed over by one
    C-level scan of its value types. Raises ProtocolError `malformed` for a msgpack extension value (a
    timestamp, say): the protocol has none, and one kept would be re-emitted as something else, or not at all."""
    level, depth = [obj], 1
    while level:
        if depth > limit:
            return True
        deeper = []
        for item in level:
            children = item.values() if type(item) is dict else item
            types = set(map(type, children))
            if types <= _SCALARS:
                continue
            if not types <= _VALUES:
                odd = next(t for t in types if t not in _VALUES)
                raise ProtocolError("malformed", f"header holds a msgpack extension value ({odd.__name__}); "
                                                 "this protocol has no extension types")
            deeper.extend(c for c in children if type(c) in _NESTING)
        level, depth = deeper, depth + 1
    return False


_plain_put_decoder = msgspec.msgpack.Decoder(messages.PlainPut)


def _plain_put(header: bytes) -> messages.PlainPut | None:
    """A PUT header of plain trajectories, decoded and checked in one pass (a third of the time of msgpack, the
    depth check and validation one after another), or None: then the general path decodes it and says what is
    wrong, so every PUT gets the answer it would get without this."""
    try:
        return _plain_put_decoder.decode(header)
    except Exception:  # whatever it is, the general path finds it and names it
        return None


def received(frames: list[Any]) -> list[bytes | memoryview]:
    """A message's frames as taken off a socket without a copy (ZeroMQ frames): protocol, command and
    header as bytes, payloads as read-only views of ZeroMQ's buffers that live as long as the message."""
    return [f.bytes for f in frames[:3]] + [f.buffer for f in frames[3:]]


def decode(frames: list[bytes], max_message_bytes: int | None = None,
           max_header_bytes: int = MAX_HEADER_BYTES, max_depth: int = MAX_DEPTH) -> Message:
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
    if command == PUT:
        typed = _plain_put(frames[2])
        if typed is not None:
            return Message(command, msgspec.to_builtins(typed), list(frames[3:]), typed)
    try:
        header = unpack(frames[2])
    except Exception as exc:  # msgpack raises several unrelated types
        reason = str(exc)[:200] or type(exc).__name__
        if "not allowed for map key" in reason:  # valid msgpack, but a map key other than a string or binary
            raise ProtocolError("malformed", f"map keys in a header are strings; one is {reason.split()[0]}") from None
        raise ProtocolError("malformed", f"header is not valid msgpack: {reason}") from None
    if not isinstance(header, dict):
        raise ProtocolError("malformed", f"header must be a msgpack map, got {type(header).__name__}")
    odd = next((key for key in header if type(key) is not str), None)  # unpack leaves strings and binary only
    if odd is not None:
        raise ProtocolError("malformed", f"map keys in a header are strings; one is {type(odd).__name__} {brief(odd)}")
    if too_deep(header, max_depth):
        raise ProtocolError("malformed", f"header nests maps and lists deeper than {max_depth} levels")
    return Message(command, header, list(frames[3:]))


def decode_reply(frames: list[bytes]) -> Message:
    """Parse a message from the broker, with the limits of replies (larger and deeper than requests)."""
    return decode(frames, max_header_bytes=MAX_REPLY_HEADER_BYTES, max_depth=MAX_REPLY_DEPTH)


# ---- field checks ---------------------------------------------------------


def field_error(what: str, exc: msgspec.ValidationError) -> ProtocolError:
    """`bad_field`, naming the field msgspec found wrong and saying so in the protocol's words."""
    text = str(exc)
    for bound in ("`float` >= -1.7976931348623157e+308", "`float` <= 1.7976931348623157e+308"):
        text = text.replace(bound, "a finite `float`")  # NaN, -inf; +inf
    if "got `null`" in text:
        text += "; leave the field out instead of sending nil"
    return ProtocolError("bad_field", f"{what}: {text[:300]}")


def validate(msg: Message) -> Struct:
    """Check a request's header against its type (rlbus.common.messages); returns the typed header, or
    raises ProtocolError `bad_field` naming the field, or `unknown_command`."""
    if msg.command not in messages.HEADERS:
        raise ProtocolError("unknown_command", f"unknown command {brief(msg.command)}; "
                                               f"known: {', '.join(sorted(messages.HEADERS))}")
    try:
        typed = msg.typed if msg.typed is not None else messages.check(msg.command, msg.header)
    except msgspec.ValidationError as exc:
        raise field_error(msg.command, exc) from None
    if msg.command == PUT:
        if len(msg.payloads) != 1:
            raise ProtocolError("bad_field", f"PUT carries exactly one payload frame, got {len(msg.payloads)}")
        total = sum(t.payload_bytes for t in typed.trajectories)
        if total != len(msg.payloads[0]):
            raise ProtocolError("bad_field", f"PUT: payload_bytes add up to {total} but the payload frame "
                                             f"has {len(msg.payloads[0])} bytes")
        for i, t in enumerate(typed.trajectories):
            if t.last_version is not msgspec.UNSET and t.last_version < t.policy_version:
                raise ProtocolError("bad_field", f"PUT: $.trajectories[{i}].last_version {t.last_version} is older "
                                                 f"than its policy_version {t.policy_version} (the oldest token's)")
    elif msg.command == PUBLISH and typed.broadcast is not msgspec.UNSET:
        _check_broadcast(typed.broadcast, typed.version)
    return typed


def _check_broadcast(b: messages.Broadcast, version: int) -> None:
    """The epoch carries the version published, and each member's ranks (`rank` … `rank + workers − 1`) lie in
    1..world−1 and are its own."""
    if b.version != version:
        raise ProtocolError("bad_field", f"PUBLISH broadcast: version {b.version} is not the version published "
                                         f"({version}); members would take the weights for another version")
    workers = {} if b.workers is msgspec.UNSET else b.workers
    strangers = sorted(set(workers) - set(b.ranks))
    if strangers:
        raise ProtocolError("bad_field", f"PUBLISH broadcast: workers names {brief(strangers)}, which ranks does not")
    spans = sorted((rank, rank + workers.get(name, 1), name) for name, rank in b.ranks.items())
    for i, (start, end, name) in enumerate(spans):
        if not 1 <= start < end <= (spans[i + 1][0] if i + 1 < len(spans) else b.world):
            taken = f"ranks {start}..{end - 1}" if end - start > 1 else f"rank {start}"
            raise ProtocolError("bad_field", f"PUBLISH broadcast: {brief(name)} takes {taken}, outside 1..world-1 "
                                             f"(world {b.world}) or shared with another member")


def join_payloads(metas: list[dict[str, Any]], payloads: list[bytes]) -> bytes:
    """The one payload frame of a PUT or BATCH; sets each meta's `payload_bytes`."""
    for meta, payload in zip(metas, payloads, strict=True):
        meta["payload_bytes"] = len(payload)
    return b"".join(payloads)


def split_payloads(metas: list[dict[str, Any]], frames: bytes | memoryview | list) -> list[memoryview]:
    """Inverse of join_payloads: one view per trajectory.

    `frames` is one payload frame or the list of a message's payload frames
    (a BATCH may send its payloads in several frames; their concatenation is
    what counts). A payload within one frame is a view of it; one that spans
    frames is joined.
    """
    parts = [memoryview(f) for f in (frames if isinstance(frames, list) else [frames])] or [memoryview(b"")]
    starts = list(itertools.accumulate((p.nbytes for p in parts), initial=0))  # where each frame starts; the end
    total = sum(meta["payload_bytes"] for meta in metas)
    if total != starts[-1]:
        raise ProtocolError("bad_field", f"payload_bytes add up to {total}, frame has {starts[-1]} bytes")
    out, offset, k = [], 0, 0
    for meta in metas:
        end = offset + meta["payload_bytes"]
        while k < len(parts) - 1 and starts[k + 1] <= offset:
            k += 1  # the frame this payload starts in
        if end <= starts[k + 1]:
            out.append(parts[k][offset - starts[k]:end - starts[k]])
        else:
            pieces, j = [], k
            while starts[j] < end:
                pieces.append(parts[j][max(offset, starts[j]) - starts[j]:min(end, starts[j + 1]) - starts[j]])
                j += 1
            out.append(memoryview(b"".join(pieces)))
        offset = end
    return out


def error(code: str, message: str, req: int | None = None) -> list[bytes]:
    header: dict[str, Any] = {"code": code, "message": message}
    if req is not None:
        header["req"] = req
    return encode(ERROR, header)

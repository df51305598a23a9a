"""The typed form of every request header, and the one trajectory type, as msgspec Structs.

docs/protocol.md gives the fields; these types are their executable form.
`protocol.validate` checks a decoded header against its Struct in one C pass
(types, ranges, lengths, required fields): a value of the wrong type, a
negative or too large integer, a float that is not finite, nil where a value
belongs, an empty or over-long id. Fields a Struct does not name are allowed and kept
as they came (the broker stores and re-emits headers as maps). A PUT of
trajectories with nothing else (`PlainPut`) is decoded straight from its
bytes into its Struct, skipping the map and the second pass. The explorer
builds its trajectory metadata from `Trajectory`, the broker validates PUTs
against it, and the trainer reads BATCH metadata through it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

MAX_ID_CHARS = 128
MAX_INT = (1 << 53) - 1  # integers are unsigned and exact in a double, in JSON and in SQLite

Int = Annotated[int, Meta(ge=0, le=MAX_INT)]
Count = Annotated[int, Meta(ge=1, le=MAX_INT)]
# Finite: NaN fails every comparison and the infinities lie outside.
Float = Annotated[float, Meta(ge=-1.7976931348623157e308, le=1.7976931348623157e308)]
Id = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]  # never empty
MAX_WORKERS = 1024  # ranks one explorer takes in a weight broadcast (its engine's workers)
Workers = Annotated[int, Meta(ge=1, le=MAX_WORKERS)]
Names = list[Id]
Dtype = Literal["auto", "bfloat16", "float16", "float32"]  # as config section `rollout` takes them
ModelPrint = Annotated[str, Meta(max_length=256)]  # "": not known to the peer


class Header(Struct, forbid_unknown_fields=False, kw_only=True):
    req: Int | UnsetType = UNSET


class Capabilities(Struct, forbid_unknown_fields=False):
    services: Names | UnsetType = UNSET
    sync_methods: Names | UnsetType = UNSET
    broadcast_backends: Names | UnsetType = UNSET
    broadcast_workers: Workers | UnsetType = UNSET


class Rollout(Struct, forbid_unknown_fields=False):
    """The run-wide sampling settings (config section `rollout`); a HELLO may carry any of them."""

    temperature: Float | UnsetType = UNSET
    top_p: Float | UnsetType = UNSET
    max_tokens: Int | UnsetType = UNSET
    dtype: Dtype | UnsetType = UNSET
    repeat: Int | UnsetType = UNSET
    seed: Int | UnsetType = UNSET
    model: ModelPrint | UnsetType = UNSET  # not a config setting: each host reads it from its model's files


class Hello(Header):
    role: Literal["explorer", "trainer", "reward", "tool"]
    name: Id
    pid: Int | UnsetType = UNSET
    host: str | UnsetType = UNSET
    session: str | UnsetType = UNSET
    policy_version: Int | UnsetType = UNSET
    capabilities: Capabilities | UnsetType = UNSET
    rollout: Rollout | UnsetType = UNSET


class Heartbeat(Struct, forbid_unknown_fields=False):
    policy_version: Int | UnsetType = UNSET


class Bye(Header):
    finished: bool | UnsetType = UNSET  # the trainer's: its last step is taken, the run is over


class Lease(Header):
    max_tasks: Count
    policy_version: Int


class Trajectory(Struct, forbid_unknown_fields=False, gc=False):
    """One trajectory's metadata (its payload is a frame of its own; see docs/protocol.md)."""

    id: Id
    group_id: Id
    task_id: Id
    group_size: Count
    batch_index: Int
    policy_version: Int
    reward: Float
    n_tokens: Int
    payload_bytes: Int
    last_version: Int | UnsetType = UNSET
    info: dict[str, Any] | UnsetType = UNSET


class Put(Header):
    trajectories: list[Trajectory]


Scalar = str | int | float | bool


class PlainTrajectory(Trajectory, forbid_unknown_fields=True, gc=False):
    """A trajectory with the named fields only and an `info` of scalars, as rlbus explorers send them."""

    info: dict[str, Scalar] | UnsetType = UNSET


class PlainPut(Put, forbid_unknown_fields=True):
    """A PUT of plain trajectories: `protocol.decode` reads it straight from its msgpack bytes in one C pass.
    A PUT it does not fit (an unnamed field, a nested `info`, or any error) takes the general path."""

    trajectories: list[PlainTrajectory]


class Fetch(Header):
    step: Int
    max_groups: Count
    min_groups: Int | UnsetType = UNSET
    batch_index: Int | UnsetType = UNSET
    skip_zero_spread: bool | UnsetType = UNSET
    wait_ms: Int | UnsetType = UNSET


class Commit(Header):
    step: Int


class Broadcast(Struct, forbid_unknown_fields=False):
    epoch: Int
    backend: str
    address: str
    world: Int
    ranks: dict[Id, Int]
    version: Int
    digest: str
    timeout_s: Float
    workers: dict[Id, Workers] | UnsetType = UNSET


class Publish(Header):
    version: Int
    method: str
    location: str
    digest: str
    step: Int | UnsetType = UNSET
    broadcast: Broadcast | UnsetType = UNSET
    fetch_from: str | UnsetType = UNSET
    fetch_key: str | UnsetType = UNSET


class Swap(Header):
    phase: Literal["begin", "end"]
    version: Int


class EvalItem(Struct, forbid_unknown_fields=False):
    text: str
    task: dict[str, Any] | UnsetType = UNSET
    token_ids: list[Any] | UnsetType = UNSET


class Eval(Header):
    service: str
    items: list[EvalItem]


class Score(Struct, forbid_unknown_fields=False):
    """One result of a reward worker's RESULT."""

    score: Float
    details: dict[str, Any] | UnsetType = UNSET
    reason: str | UnsetType = UNSET


class Result(Struct, forbid_unknown_fields=False):
    job: Int
    results: list[Any]  # checked as Scores by the broker's reward router: a bad answer sends the job elsewhere


class Scores(Struct, forbid_unknown_fields=False):
    """A RESULT's results as the broker checks them before the asker gets them."""

    results: list[Score]


HEADERS: dict[str, type[Struct]] = {
    "HELLO": Hello, "HEARTBEAT": Heartbeat, "BYE": Bye, "LEASE": Lease, "PUT": Put, "FETCH": Fetch,
    "COMMIT": Commit, "PUBLISH": Publish, "STATUS": Header, "EVAL": Eval, "RESULT": Result, "SWAP": Swap,
}


def fields(struct: type[Struct]) -> tuple[str, ...]:
    return struct.__struct_fields__


def check(command: str, header: dict[str, Any]) -> Struct:
    """The header as its Struct; raises msgspec.ValidationError naming the field (`$.trajectories[3].reward`)."""
    return msgspec.convert(header, HEADERS[command], strict=True)

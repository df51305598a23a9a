"""The trainer on several ranks: FSDP2 over torch.distributed.

With `trainer.world_size` > 1, `rlbus trainer` runs that many ranks (started
by `rlbus.trainer.ranks`, or by torchrun, which sets RANK and WORLD_SIZE, on
one or several hosts). The model is sharded with `fully_shard`, one unit per
decoder layer and the rest (embeddings, final norm, tied LM head) in the
root, so a rank holds 1/world_size of the weights, gradients and optimizer
states.

Rank 0 alone speaks to the broker (FETCH, COMMIT, PUBLISH) and tells the
other ranks what to do, step by step, as a `Plan` broadcast over the process
group (msgpack, like the wire). Every rank decodes the same batch and trains
its share of its micro-batches; FSDP2 reduce-scatters the gradients (summed,
not averaged: each micro-batch's loss is already scaled by its share of the
whole batch), so a step at world size N takes the update of the single
process on the same batch, up to summation order.

Collective work runs on every rank in the same order: the training thread's
(steps, sharded checkpoints) over the default group, the publishing
threads' (gathering the weights of a version from the shards) over a group of
their own, so that publishing never holds up training.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from rlbus.common import protocol as P
from rlbus.trainer.ranks import STORE_FD, rank_env


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def init(cfg) -> World | None:
    """Join the process group of this rank (None for a single-process trainer)."""
    t = cfg.trainer
    ranks = rank_env()
    if ranks is None:
        if t.world_size > 1:
            raise RuntimeError("trainer.world_size > 1 needs RANK and WORLD_SIZE (rlbus trainer or torchrun set them)")
        return None
    rank, size, local = ranks
    if t.world_size not in (1, size):
        raise ValueError(f"trainer.world_size is {t.world_size} but this trainer was started with {size} ranks "
                         f"(WORLD_SIZE); set trainer.world_size={size} or start {t.world_size} ranks")
    device = torch.device(t.device)
    if device.type == "cuda":
        device = torch.device("cuda", local)  # one GPU per rank of a host
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    timeout = timedelta(seconds=t.collective_timeout_s)
    if STORE_FD in os.environ:  # started by `rlbus trainer`: rank 0's store serves on the socket it was handed
        fd = os.environ.pop(STORE_FD)
        kwargs["store"] = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, rank == 0,
                                        timeout, wait_for_workers=False, master_listen_fd=int(fd) if fd else None)
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout, **kwargs)
    return World(rank, size, local, device)


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- the model --------------------------------------------------------------


class Policy(torch.nn.Module):
    """The HF model behind one forward: `policy(fn, **kw)` runs `fn(model, **kw)`.

    The trainer's log-probabilities call the decoder and the LM head
    separately; under FSDP2 the root's parameters (embeddings, tied head)
    are gathered around the root's forward only, so that computation must
    run inside it. Unsharded it is a plain call.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn: Callable, **kwargs):
        return fn(self.model, **kwargs)


def shard(model: torch.nn.Module, world: World) -> Policy:
    """Shard `model` across the world with FSDP2: one unit per decoder layer, the rest in the root. Parameters
    keep their dtype (no MixedPrecisionPolicy): autocast (`trainer.autocast`) gives mixed precision, as on one
    process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(world.device.type, (world.size,))
    policy = Policy(model)
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            # Summed, not averaged: the micro-batches' loss shares already add up to the batch's mean. (A plain
            # SUM: gloo has no pre-multiplied sum.)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return policy


def micro_batches(count: int, world: World | None) -> list[int | None]:
    """This rank's micro-batches of `count`, round-robin. Every rank runs the same number of forward/backward
    passes (each gathers every layer), so a rank that has fewer gets None: a pass that contributes nothing."""
    if world is None:
        return list(range(count))
    mine: list[int | None] = list(range(world.rank, count, world.size))
    return mine + [None] * (-(-count // world.size) - len(mine))


def all_sum(values: list[float], world: World | None) -> list[float]:
    if world is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device(world))
    dist.all_reduce(t)
    return t.tolist()


def _comm_device(world: World) -> torch.device:
    return world.device if dist.get_backend() == "nccl" else torch.device("cpu")


# ---- rank 0 tells the others what to do --------------------------------------


@dataclass
class Plan:
    """One instruction from rank 0: `train` a BATCH (its frames) then maybe publish and checkpoint, `finish` (the
    taskset ran out: publish and checkpoint the last step trained, as flagged), `wait` (rank 0 is still waiting on
    the broker; keeps the others' collective from timing out), or `stop`."""

    op: str
    step: int = 0
    publish: bool = False
    checkpoint: bool = False
    frames: list[bytes] = field(default_factory=list)

    def reply(self) -> P.Message:
        return P.decode_reply(self.frames)


def send(plan: Plan, world: World) -> None:
    _broadcast(P.pack({"op": plan.op, "step": plan.step, "publish": plan.publish, "checkpoint": plan.checkpoint,
                       "frames": plan.frames}), world)


def receive(world: World) -> Plan:
    d = P.unpack(_broadcast(None, world))
    return Plan(d["op"], d["step"], d["publish"], d["checkpoint"], d["frames"])


def _broadcast(data: bytes | None, world: World) -> bytes:
    device = _comm_device(world)
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data is not None
           else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    dist.broadcast(buf, src=0)
    return buf.cpu().numpy().tobytes()


# ---- full weights from the shards ----------------------------------------------


class Gathered:
    """How a sharded trainer publishes: `freeze()` on the training thread copies each rank's shards (in the
    publishing dtype: a bfloat16 publish moves half the bytes of float32 weights), which takes a moment; the
    publishing thread of every rank then gathers them, tensor by tensor, over a process group of its own, while
    training goes on over the default one."""

    def __init__(self, policy: Policy, world: World, dtype: torch.dtype | None = None):
        from transformers import AutoModelForCausalLM

        self.model = policy.model
        self.world = world
        self.dtype = dtype
        with torch.device("meta"):
            self.skeleton = AutoModelForCausalLM.from_config(self.model.config, dtype=self.model.dtype)
        self.group = dist.new_group(backend=dist.get_backend())  # collective: every rank, in the same order

    def freeze(self) -> "Frozen":
        return Frozen(self.skeleton, FullState(self.model, self.world, self.group, self.dtype))


class Frozen:
    """One version as a weight sender takes it: the architecture on the meta device (its `save_pretrained`
    writes the config under the model's own class name) with `state_dict()` the version's full weights,
    gathered from the shards as the sender reads them. No rank holds a second full copy: each gathered tensor
    is the sender's to keep or to pack into its buckets. Ranks other than 0 `drain()` it (the gathers are
    collective, every rank reads in the same order)."""

    def __init__(self, skeleton, state: "FullState"):
        self.skeleton = skeleton
        self.state = state

    def state_dict(self) -> "FullState":
        return self.state

    def drain(self) -> None:
        for _ in self.state.items():
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.skeleton, name)


class FullState:
    """The shards of a model's state dict, copied now, read later as full tensors (each gathered on every rank as
    it is read). Tied entries (embedding and LM head: one parameter under two names) are gathered once and read
    as the same tensor, as in a plain state dict."""

    def __init__(self, model: torch.nn.Module, world: World, group, dtype: torch.dtype | None = None):
        from torch.distributed.tensor import DTensor

        self.world, self.group, self.dtype = world, group, dtype
        params = dict(model.named_parameters(remove_duplicate=False))
        sharded = model.state_dict()
        self.tie = {name: id(params[name]) if name in params else name for name in sharded}
        self.shapes: dict[str, torch.Size] = {}
        self.local: dict[str, torch.Tensor] = {}  # this rank's shard (dim 0, as fully_shard splits), or the tensor
        self.split: set[str] = set()
        first: dict[Any, str] = {}
        for name, t in sharded.items():
            if first.setdefault(self.tie[name], name) != name:
                continue  # a tied duplicate: read as its first name
            self.shapes[name] = t.shape
            if isinstance(t, DTensor):
                self.split.add(name)
                t = t.to_local()
            cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
            self.local[name] = t.detach().to(cast, copy=True)
        self.first = {name: first[self.tie[name]] for name in sharded}

    def keys(self):
        return self.first.keys()

    def __len__(self) -> int:
        return len(self.first)

    def unique_meta(self) -> list[tuple[str, torch.Tensor]]:
        """(name, meta tensor of the full shape and dtype) per distinct tensor, without gathering."""
        return [(name, torch.empty(self.shapes[name], dtype=t.dtype, device="meta")) for name, t in self.local.items()]

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        gathered: dict[str, torch.Tensor] = {}
        tied = {n for n, uses in Counter(self.first.values()).items() if uses > 1}
        for name, stored in self.first.items():
            if stored in gathered:
                yield name, gathered[stored]
                continue
            full = self._gather(stored) if stored in self.split else self.local[stored]
            if stored in tied:
                gathered[stored] = full
            yield name, full

    def _gather(self, name: str) -> torch.Tensor:
        """fully_shard splits dim 0 in chunks of ceil(n / world) (the last ones shorter or empty): pad to the
        chunk, gather, trim."""
        local, shape = self.local[name], self.shapes[name]
        chunk = -(-shape[0] // self.world.size)
        padded = local.new_zeros((chunk, *shape[1:]))
        padded[:local.shape[0]] = local
        out = local.new_empty((chunk * self.world.size, *shape[1:]))
        dist.all_gather_into_tensor(out, padded, group=self.group)
        return out[:shape[0]]

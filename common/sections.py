"""The sections of a run's configuration, one per process or concern (`config.py` assembles and loads them). Every
field has a docstring (shown by `rlbus config` tools and in errors) and a default that works on one machine."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from rlbus.common.messages import MAX_ID_CHARS, MAX_WORKERS
from rlbus.common.protocol import dialable


class Section(BaseModel):
    # Every number finite: an infinite lr, temperature or timeout is a typo, never a setting.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)


class ModelConfig(Section):
    path: str = "smollm2-135m"
    """Model to train and sample: a bundled name (`smollm2-135m`), a local HF model directory, or a hub id."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for training (float32 on CPU; bfloat16 on GPUs)."""
    cache_dir: str = ""
    """Where bundled models are prepared; empty means ~/.cache/rlbus/models."""


class DataConfig(Section):
    taskset: Literal["arith", "countdown", "guess", "file"] = "arith"
    """Where tasks come from: generated `arith` (a + b), `countdown`, `guess` (multi-turn), or a `file`."""
    seed: int = 0
    """Seed of generated training tasks."""
    max_operand: int = Field(20, ge=1)
    """Generated tasksets: operands (arith, countdown) or the secret (guess) go up to this."""
    max_turns: int = Field(5, ge=1)
    """guess: turns the model gets."""
    path: str = ""
    """file: a .jsonl or .parquet file, or a saved HF `datasets` directory; a row's `kind` names the reward
    that `reward.fn: auto` scores it with (math, code, exact, ...)."""
    eval_path: str = ""
    """file: the held-out set (same format); empty means no held-out set."""
    prompt_field: str = "prompt"
    """file: the field holding the prompt."""
    answer_field: str = "answer"
    """file: the field holding the reference answer."""
    epochs: int = Field(1, ge=1)
    """file: passes over the rows."""
    batch_tasks: int = Field(4, ge=1)
    """Tasks (prompts) per explorer batch; the trainer trains on this many groups per step."""
    max_tasks: int = Field(0, ge=0)
    """Stop issuing tasks after this many (0: no limit; generated tasksets are endless)."""
    eval_seed: int = 1234
    """Seed of the held-out evaluation set."""
    eval_size: int = Field(100, ge=0)
    """Problems in the held-out evaluation set."""
    revisit: float = Field(0.0, ge=0, lt=1)
    """Share of each batch given to tasks issued again: those whose last group's rewards differed (solved
    sometimes), from two batches on; 0: every task is new."""
    revisit_times: int = Field(2, ge=1)
    """revisit: how many times one task may be issued again."""

    @model_validator(mode="after")
    def _file_needs_path(self) -> "DataConfig":
        if self.taskset == "file" and not self.path:
            raise ValueError("data.taskset=file needs data.path (a .jsonl or .parquet file, or a datasets directory)")
        return self


class AlgorithmConfig(Section):
    advantage: Literal["grpo", "grpo_batch", "dr_grpo", "rloo", "reinforce_pp"] = "grpo"
    """Advantage estimator: grpo (reward less its group's mean, over its group's std), grpo_batch (over the std of
    the batch's rewards instead, TRL's scale_rewards batch; all-equal groups are kept by default, so the std is the
    whole batch's), dr_grpo (less the group's mean), rloo (less the mean of the group's other samples), reinforce_pp
    (whitened over the batch's tokens)."""
    skip_zero_spread: bool | None = None
    """Drop groups whose rewards are all equal before compute; default: on for grpo, dr_grpo and rloo."""
    fill_batch: bool = False
    """async: wait until the batch holds `batch_tasks` informative groups (dynamic sampling); lockstep trains each batch's informative groups."""
    informative_wait_s: float = Field(60.0, gt=0)
    """async: how long a step waits for informative groups before it takes what there is, all-equal ones
    included (they add nothing to the update, but the step counts: a run whose reward has saturated still ends)."""
    clip_low: float = Field(0.2, ge=0)
    """PPO clip: ratio floor 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0)
    """PPO clip: ratio ceiling 1 + clip_high."""
    ratio_level: Literal["token", "sequence"] = "token"
    """The PPO ratio pi / pi_proximal per token, or per sequence (GSPO: its tokens' geometric mean, clipped as one; as
    TRL's importance_sampling_level sequence and verl's gspo, with clip ranges near 3e-4, 4e-4). It is 1 in value
    with one update per batch; it moves with several (mini_batches, epochs)."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual clip c: bounds the loss of negative-advantage tokens by -c * A (off when unset)."""
    is_mode: Literal["truncate", "mask"] = "truncate"
    """Off-policy importance weights: truncate at is_cap, or mask tokens outside [is_low, is_high]."""
    is_cap: float = Field(2.0, gt=0)
    """truncate: largest importance weight."""
    is_low: float = Field(0.5, ge=0)
    """mask: smallest importance weight kept."""
    is_high: float = Field(2.0, gt=0)
    """mask: largest importance weight kept."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL term to the frozen reference model (0: no reference model is loaded)."""
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator in the loss (x = log pi - log ref): k1 = x, k2 = x^2/2 (its gradient is that of KL(pi || ref)),
    k3 = exp(-x) + x - 1 (its gradient is that of the forward KL(ref || pi): it pulls back up tokens the policy learnt
    to avoid)."""
    kl_clamp: float | None = Field(None, gt=0)
    """Bound on each token's KL estimate, as [-kl_clamp, kl_clamp] (off when unset). A token beyond it adds a
    constant and no gradient: under k3, a sampled token the policy now finds far less likely than the reference
    did (x below about -2.6 for a bound of 10) no longer dominates the step with its weight 1 - ref/pi."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                         "seq-mean-token-sum-norm"] = "token-mean"
    """How token losses become the batch loss: the mean over the batch's tokens; the mean over sequences of each
    one's token mean, or of its token sum; or of its token sum over rollout.max_tokens (Dr. GRPO's constant, as TRL's
    loss_type dr_grpo)."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per pass over a fetched batch, each on a mini-batch of (nearly) equal samples in order (verl's
    train_batch_size / ppo_mini_batch_size), in micro-batches. Beyond one update a batch, the ratio is to the policy
    before the batch's first update: one more forward pass, without gradients."""
    epochs: int = Field(1, ge=1)
    """Passes over each fetched batch (verl's ppo_epochs, TRL's num_iterations), each of `mini_batches` steps. The
    learning-rate schedule still moves once per trainer step."""
    loss_denominator: Literal["trained", "batch"] = "trained"
    """What the batch loss is averaged over: the samples trained on, or the whole batch, its all-equal-reward
    groups (dropped by the broker or the trainer) counted as samples of advantage 0, as in TRL's GRPOTrainer,
    which keeps them. `batch` scales the loss by trained samples / batch samples, so a step in which few
    groups are informative moves the policy less: as the reward saturates, the updates shrink with it."""

    def drops_zero_spread(self) -> bool:
        return self.advantage in ("grpo", "dr_grpo", "rloo") if self.skip_zero_spread is None else self.skip_zero_spread


class SyncConfig(Section):
    sync_interval: int = Field(1, ge=1)
    """I: the trainer publishes weights every I trainer steps (one fetched batch each)."""
    sync_offset: int = Field(0, ge=0)
    """O: explorer batches run ahead of the first sync."""
    sync_style: Literal["lockstep", "async"] = "lockstep"
    """lockstep: batch e waits for version >= floor((e - O)/I)*I; async: never wait, use the newest weights."""
    max_staleness: int | None = Field(None, ge=0)
    """S: a trajectory from version v is trained at step t only if t - v <= S. Default: O + I - 1 (lockstep), I + O + 1 (async)."""
    sync_method: Literal["checkpoint", "nccl"] = "checkpoint"
    """How explorers receive new weights: checkpoint (files), or nccl (broadcast to the epoch's members, then a
    checkpoint for everyone else)."""
    sync_timeout_s: float = Field(60.0, gt=0)
    """Upper bound on every wait of a weight sync (a broadcast that runs past it is aborted)."""
    broadcast_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """nccl method: the communicator; auto means cupy NCCL where CUDA is present, else torch gloo (CPU)."""
    rendezvous_host: Host = "127.0.0.1"
    """nccl method: the trainer's address that explorers reach for the broadcast rendezvous."""
    rendezvous_port: int = Field(0, ge=0, le=65535)
    """nccl method: the rendezvous store's port on the trainer (0: a free one, announced on the bus)."""
    bucket_mb: float = Field(64.0, gt=0)
    """nccl method: weights travel in flat buckets of at most this size."""
    serve: bool = True
    """Serve every published version over the network (weights/server.py), so explorers that cannot read the
    trainer's run directory fetch it, as deltas against the version they hold."""
    serve_host: Host = "127.0.0.1"
    """The interface the trainer's weight server binds (0.0.0.0: every IPv4 one; `::`: every one)."""
    serve_port: int = Field(0, ge=0, le=65535)
    """The weight server's port (0: a free one; the bus announces it)."""
    serve_advertise: HostOrEmpty = ""
    """The host explorers dial for weights (default: serve_host, or this machine's hostname for 0.0.0.0 or ::)."""
    serve_authorized_dir: str = ""
    """With CurveZMQ on: the client public keys the weight server admits (default: broker.curve_authorized_dir)."""
    serve_deltas: bool = True
    """Send an explorer that holds a recent version only what changed (zstd XOR); off: always whole versions. A delta
    costs CPU (about 0.6 s per version of a 135M model, built once whoever asks): see serve_delta_priority."""
    serve_delta_priority: Literal["idle", "normal"] = "idle"
    """idle: deltas are built in a child process on CPU that training leaves (Linux SCHED_IDLE), so they do not
    slow a step; an explorer whose delta is not ready within the time its last whole version took (at once when the
    builder is behind) gets the whole version. normal: deltas compete with training for the CPU (on a trainer
    training on one CPU core, with two explorers: steps 12-16% slower, against 8-14% at idle priority and 9-10%
    for whole versions), for a trainer without spare CPU whose explorers are on a slow network."""
    serve_chunk_mb: float = Field(4.0, gt=0, le=64)
    """Weights travel in chunks of this size, each checked on arrival."""
    max_swapping: int = Field(0, ge=0)
    """Streaming explorers with sync_style async swap new weights in with their requests in flight; at most this
    many at once (the broker grants the slots), so the fleet never stops generating together. 0: no limit.
    Members of a broadcast load together whatever this says."""
    swap_timeout_s: float = Field(60.0, gt=0)
    """A swap slot its explorer has not given back after this long is freed."""

    @model_validator(mode="after")
    def _staleness(self) -> "SyncConfig":
        floor = self.sync_offset + self.sync_interval - 1
        if self.max_staleness is None:
            default = floor if self.sync_style == "lockstep" else floor + 2
            object.__setattr__(self, "max_staleness", default)
        elif self.sync_style == "lockstep" and self.max_staleness < floor:
            raise ValueError(f"max_staleness={self.max_staleness} is too small for lockstep with sync_interval="
                             f"{self.sync_interval} and sync_offset={self.sync_offset}: the oldest data is sync_offset"
                             f" + sync_interval - 1 = {floor} versions behind; set max_staleness >= {floor}")
        return self

    def required_version(self, batch_index: int) -> int:
        """Lockstep: the oldest policy version allowed to generate explorer batch `batch_index`."""
        return max(0, (batch_index - self.sync_offset) // self.sync_interval * self.sync_interval)


def _endpoint(value: str) -> str:
    """A broker address as clients dial it: tcp://HOST:PORT (HOST a name, an IPv4 address or [IPv6])."""
    if value and not dialable(value):
        raise ValueError("must be tcp://HOST:PORT (PORT 1 to 65535), e.g. tcp://10.0.0.5:5555")
    return value


Endpoint = Annotated[str, AfterValidator(_endpoint)]

_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?|\*")  # a host name or IPv4 address; *: every one


def checked_host(value: str) -> str:
    """A host to bind or to dial, as `broker.host` and the others take it: a name, an IPv4 address or an IPv6
    address (brackets around it are dropped); never a URL or a port."""
    bare = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    if not _NAME.fullmatch(bare) and not _ipv6(bare):
        raise ValueError("must be a host name or an IP address, without a port (0.0.0.0 or :: for every interface)")
    return bare


def _ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


Host = Annotated[str, AfterValidator(checked_host)]
HostOrEmpty = Annotated[str, AfterValidator(lambda value: value and checked_host(value))]


class RolloutConfig(Section):
    """What every process of a run must agree on about how samples are drawn. The broker sends it to each
    explorer in WELCOME and refuses one whose own settings differ; the trainer's importance weights assume it."""

    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (the trainer scales its logits by the same)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling."""
    max_tokens: int = Field(24, ge=1)
    """New tokens per response."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """The dtype weights are published in and explorers' engines compute in. auto: bfloat16 where the host computes
    in it (a CUDA GPU that supports it, else float16 there; a CPU with AVX512-BF16 or AMX, timed faster in it),
    float32 on other CPUs. Each process resolves auto on its own host and the broker pins the first answer for the
    run: across hosts of different kinds, set it explicitly."""
    repeat: int = Field(8, ge=1)
    """Samples generated per task (the group size)."""
    seed: int = Field(0, ge=0)
    """The run's seed: the engines' sampling and the trainer's initialisation."""


class ExplorerConfig(Section):
    name: str = Field("", max_length=MAX_ID_CHARS)
    """Peer name; empty means explorer-<host>-<pid>."""
    tasks_per_lease: int = Field(4, ge=1)
    """Tasks asked for per LEASE."""
    eval_every: int = Field(0, ge=0)
    """Greedy accuracy on the held-out set every this many policy versions, and at versions 0 and the last (0: never)."""
    eval_overlap: bool = False
    """Batch at a time: evaluate a version after PUTting its batch, while the trainer trains on it, not between leasing
    the batch and rolling it out (where a lockstep run waits). For engines with a device or cores of their own: on
    cores a CPU trainer shares, each slows the other many times over (`rlbus up` warns)."""
    receive: Literal["auto", "checkpoint", "fetch"] = "auto"
    """auto: join the broadcast group when the run uses sync_method nccl, else read the announced directory when
    this host can, else fetch from the trainer's weight server; checkpoint: never join a broadcast; fetch: always
    fetch, never read the trainer's directory."""
    weights_dir: str = ""
    """Where fetched versions are kept (default: run.dir/fetched/NAME)."""
    fetch_from: Endpoint = ""
    """Fetch from this weight server (tcp://HOST:PORT of an `rlbus mirror`) instead of the one the bus announces;
    versions are still checked against the bus's digest."""
    fetch_key: str = ""
    """With CurveZMQ on and fetch_from set: that server's public key (the mirror logs it as it starts)."""
    fetch_timeout_s: float = Field(120.0, gt=0)
    """A fetch that gets no reply from the weight server for this long fails (and is tried again later)."""
    delta_wait_s: float | None = Field(None, ge=0)
    """How long a fetch waits for the trainer to build a delta before it takes the whole version instead (empty:
    as long as this explorer's last whole version took to arrive, so that it waits for a delta only where one can
    come sooner; more, where the network's bytes cost more than the time)."""
    overlap_fetch: bool = True
    """Batch at a time: reload the engine while a fetch is still arriving, each tensor once its chunks are in
    (weights/stream.py), instead of after the last chunk. Only from a version fetched before, which the engine
    goes back to if the fetch fails. Streaming explorers keep generating during a fetch and never overlap."""
    memory_fraction: float = Field(0.3, gt=0, le=1)
    """vLLM gpu_memory_utilization; on CPU the share of host memory it reserves (0.3 works, the default 0.9 does not)."""
    kv_cache_mb: int | None = Field(None, gt=0)
    """Each worker's KV cache in MiB (vLLM kv_cache_memory_bytes), instead of what memory_fraction leaves: on CPU a
    share of the NUMA node's memory, which a small or resized host (virtio-mem, a balloon) can leave empty."""
    max_model_len: int = Field(0, ge=0)
    """Tokens of prompt and response the engine holds a sample (vLLM max_model_len); 0: max(1024, rollout.max_tokens
    + 512), within the model's context (max_position_embeddings)."""
    tensor_parallel: int = Field(1, ge=1, le=MAX_WORKERS)
    """vLLM tensor_parallel_size: the engine's workers (one GPU each) that split every layer. A weight broadcast
    reaches each worker, as a rank of its own."""
    streaming: bool = False
    """Keep the engine full: lease tasks as slots free up, PUT each group as soon as its last sample ends, and
    (sync_style async) swap new weights in between two engine steps with the requests in flight kept. Off: a
    batch at a time, new weights between batches."""
    inflight_tasks: int = Field(0, ge=0)
    """Streaming: the engine is kept generating up to this many tasks' samples (inflight_tasks x repeat sequences):
    a task is leased as soon as samples that ended leave room for its own, even while their group waits for its
    slowest one. 0: tasks_per_lease."""
    swap_kv: Literal["recompute", "keep"] = "recompute"
    """Requests in flight when new weights are swapped in: recompute their KV under the new weights (exact: each token
    is sampled from the version it is labelled with; a prefill of everything in flight per swap), or keep it (later
    tokens attend to KV older weights computed, logprobs still those sampled with; prefix caching is then off)."""
    swap_lag: int = Field(1, ge=1)
    """Streaming with in-flight updates: swap once the newest announced version is this many ahead of the
    engine's, and then to the newest (2 halves the pauses when every version is published). Must stay within
    sync.max_staleness; broadcast members load every epoch whatever this says."""
    engine_core: Literal["auto", "inline", "process"] = "auto"
    """Where vLLM's engine core runs: inside the explorer process, or in a process of its own. auto: inline on
    vLLM's CPU build (the tiny model's engine starts in ~5 s instead of ~24 s, and generates on all the
    explorer's cores), a process of its own on GPUs."""
    threads: int = Field(0, ge=0)
    """CPU threads the engine computes on, with its core inline (0: one per core the explorer may use). Fewer
    where other processes share its cores: its threads wait on each other (README, "Sharing the cores")."""


class TrainerConfig(Section):
    name: str = Field("trainer", min_length=1, max_length=MAX_ID_CHARS)
    """Peer name."""
    lr: float = Field(1e-5, gt=0)
    """Learning rate (AdamW)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    fused_optimizer: bool = False
    """AdamW's fused kernel, not torch's default: a default-task step on 2 CPU cores about 0.3 s sooner, equal to
    float rounding only, so a run takes another path (docs/architecture.md, Trainer)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up over this many steps: step k (from 0) trains at lr x (k + 1) / warmup_steps, so
    no step is spent at lr 0 (Hugging Face's schedulers start there, one step behind)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up: keep lr, or decay it to lr x min_lr_ratio at total_steps (linearly or along a cosine)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Where a decaying schedule ends, as a fraction of lr."""
    decay_steps: int = Field(0, ge=0)
    """A decaying schedule's length: it holds lr until total_steps - decay_steps, then decays (warm-up, stable,
    decay); 0: it decays from the end of warm-up."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the gradient norm to this."""
    total_steps: int = Field(100, ge=0)
    """Trainer steps in the run."""
    micro_batch: int = Field(8, ge=1)
    """Sequences per forward/backward pass (gradient accumulation over the batch)."""
    shared_prompt: bool = True
    """Train each micro-batch as one packed sequence in which a prompt shared by several samples (a group's,
    and the prefix common to all groups) is computed once: same loss and gradients as one row per sample, with
    fewer tokens (trainer/packing.py). Models whose attention takes no custom mask fall back to rows."""
    checkpoint_every: int = Field(10, ge=0)
    """Save a training checkpoint every K steps and at the last (0: never; then every step is committed at once)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Training checkpoints kept on disk."""
    device: str = "cpu"
    """Torch device (cpu, cuda, cuda:1, ...). With world_size > 1: cpu or cuda (each rank takes the GPU of its
    LOCAL_RANK)."""
    world_size: int = Field(1, ge=1)
    """Ranks of the trainer (FSDP2: weights, gradients and optimizer states sharded across them). `rlbus trainer`
    starts them on this host; on several hosts start it with torchrun (README, "Training on several GPUs")."""
    collective_timeout_s: float = Field(1800.0, gt=0)
    """With world_size > 1: how long a rank waits in one collective (a rank that died is noticed sooner, by
    `rlbus trainer`, which stops the others at once)."""
    threads: int = Field(0, ge=0)
    """CPU threads for torch (0: torch's default, one per core). Fewer where other processes share its cores: its
    threads wait on each other (README, "Sharing the cores")."""
    deterministic: bool = True
    """Deterministic algorithms (torch.use_deterministic_algorithms; on GPUs also CUBLAS_WORKSPACE_CONFIG), so
    that `rlbus replay` trains the same batches to the same weights bit for bit, given the same device kind,
    torch version and thread count (recorded in RUN_DIR/trainer.json). Costs some speed on GPUs."""
    gradient_checkpointing: bool = False
    """Trade compute for memory."""
    autocast: Literal["off", "bfloat16", "float16", "auto"] = "off"
    """Mixed precision for forward and backward, master weights in model.dtype (bfloat16: ~1.7x faster on some CPUs
    with AVX512-BF16 or AMX, ~25x slower on CPUs without); auto: bfloat16 where rollout.dtype auto takes it."""
    fetch_wait_s: float = Field(5.0, gt=0)
    """How long one FETCH waits at the broker for enough groups before asking again."""
    broker_timeout_s: float = Field(30.0, gt=0)
    """How long the trainer waits for one reply from the broker before logging `broker_unreachable_waiting`
    and asking again. The trainer never gives up: a broker restart of any length only pauses training."""
    wait_for_explorers: int = Field(0, ge=0)
    """The broker of a fresh run leases no task until this many explorers have joined it (0: at once), and the
    trainer's first step waits with it, so that explorers whose engines start more slowly take part from the
    start. The broker's setting decides (the trainer follows its STATUS). `rlbus up` sets it to
    `launch.explorers` (see `launch.start_together`)."""
    wait_for_explorers_s: float = Field(600.0, gt=0)
    """How long after the broker starts that wait lasts at most; then training starts with the explorers there
    are (logged)."""

    @model_validator(mode="after")
    def _ranks(self) -> "TrainerConfig":
        if self.world_size > 1 and ":" in self.device:
            raise ValueError(f"trainer.device={self.device} names one GPU, but trainer.world_size={self.world_size} "
                             "ranks need one each: set trainer.device=cuda (each rank takes the GPU of its "
                             "LOCAL_RANK; choose GPUs with CUDA_VISIBLE_DEVICES)")
        return self

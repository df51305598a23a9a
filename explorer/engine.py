"""The explorer's vLLM engine: sampling with behaviour logprobs, and in-place weight loads.

One `vllm.LLM` per explorer process, driven a step at a time. `submit` adds
a request (prompt token ids, `n` samples); `step` runs one engine step and
returns the requests it finished, each sample with its token ids, the
logprob of every sampled token under the distribution it was sampled from
(`logprobs_mode="processed_logprobs"`: after temperature and top-p), the
finish reason, the text, and the policy versions its tokens came from.
`generate` is submit-and-step-until-done for a list of prompts; requests
other callers have in flight go on meanwhile and are kept for their `step`.

`reload` loads a version into the running engine from a weight-sync source
(rlbus.weights.sync chooses it and checks digests) between two steps, with
the requests in flight kept: it pauses the scheduler, loads the weights in
every worker, labels later steps with the new version, empties the prefix
cache and recomputes the running requests' KV under the new weights (so no
token after the swap is sampled from a cache the old weights wrote), then
resumes. A sample that spans the swap so records where its tokens changed
version, and each token's logprob is the one it was sampled with. With
`swap_kv="keep"` the running requests keep their KV instead (no recompute;
their later tokens attend to KV earlier weights computed, as PipelineRL
does) and prefix caching is off, so no request reuses another's KV.

vLLM spawns processes: create an Engine only under `if __name__ == "__main__"`
or in a process started by the CLI.
"""

from __future__ import annotations

import gc
import itertools
import os
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Sequence

import structlog

from rlbus.common import metrics
from rlbus.common.processes import freeze_heap, heap_kept_frozen, refreeze_heap
from rlbus.explorer.lifeline import owning_engines, remove_sockets, started_with

log = structlog.get_logger()


def inline_core(core: str) -> bool:
    """Whether vLLM's engine core runs inside the explorer process: `inline`, `process`, or `auto` (inline on
    vLLM's CPU build, where it starts about 4x faster and generates on every core the process may use; in a
    process of its own on GPUs, where it overlaps scheduling with the device's work)."""
    if core not in ("auto", "inline", "process"):
        raise ValueError(f"engine core must be auto, inline or process, not {core!r}")
    if core != "auto":
        return core == "inline"
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@dataclass(slots=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    versions: list[tuple[int, int]]  # (first token index, policy version) for each run of tokens one version sampled


def without_chat_template(tokenizer) -> bool:
    """A base model's tokenizer: its template is None. One with no such attribute (a wrapper that templates by
    itself) has one."""
    return getattr(tokenizer, "chat_template", "") is None


class Engine:
    # Its reload may wait for a fetch that is still arriving (weights/stream.py): between batches nothing waits
    # on the engine. A streaming explorer reloads through its swap slot, which does not say so.
    overlaps_fetch = True

    def __init__(self, model: str, *, dtype: str = "bfloat16", seed: int = 0, max_model_len: int = 1024,
                 memory_fraction: float = 0.3, kv_cache_mb: int | None = None, enforce_eager: bool = True,
                 version: int = 0, core: str = "auto", swap_kv: str = "recompute", tensor_parallel: int = 1,
                 threads: int = 0):
        if swap_kv not in ("recompute", "keep"):
            raise ValueError(f"swap_kv must be recompute or keep, not {swap_kv!r}")
        started = time.monotonic()
        self.swap_kv = swap_kv
        self.max_model_len = max_model_len  # prompt and response tokens of one sample
        self.inline = inline_core(core)
        if threads and not self.inline:
            raise ValueError("explorer.threads sets the threads of an engine core inline (explorer.engine_core); "
                             "one in a process of its own takes its cores from VLLM_CPU_OMP_THREADS_BIND")
        # vLLM reads this when the engine is built: "0" runs its engine core and worker in this process. Set
        # either way, and read afresh: an engine built earlier in this process set it, and its core cached
        # vLLM's environment when it started (vllm.envs.enable_envs_cache).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.inline else "1"
        from vllm import envs

        getattr(envs, "disable_envs_cache", lambda: None)()
        from vllm.platforms import current_platform

        # The model is not compiled (enforce_eager), but vLLM's sampler compiles one op with torch.compile at the
        # first sample (a sampled token's rank among the logprobs, vllm.v1.sample.ops.logprobs): on CPUs 2.1-3.0 s
        # of each inline engine's warm-up, 17 s of one in a process of its own, and a C++ compiler run the first
        # time on a host, for an op that runs eager in well under a millisecond. Off where the engine core runs
        # (this process, or by the environment its processes start with): the first generation took 0.2 s so.
        compile_off = enforce_eager and current_platform.is_cpu()
        if self.inline:
            import torch

            if threads:  # before vLLM's CPU worker starts, which then refuses torch.set_num_threads
                torch.set_num_threads(threads)
            threads = torch.get_num_threads()
            if compile_off:
                torch._dynamo.config.disable = True
        from vllm import LLM

        # vLLM's engine core freezes the whole heap once it is built (ours too, with its core inline); frozen
        # first, what the imports made is left out of the collections the build itself runs (model loading,
        # memory profiling): the tiny model's engine was built in 4.4-4.9 s so, 6.8-8.3 s without.
        freeze_heap()
        children_env = {"TORCH_COMPILE_DISABLE": "1"} if compile_off and not self.inline else {}
        # its processes end when this one does, even by SIGKILL
        with owning_engines() as self._sockets, started_with(children_env):
            self.llm = LLM(model=model, dtype=dtype, seed=seed, max_model_len=max_model_len,
                           gpu_memory_utilization=memory_fraction, enforce_eager=enforce_eager,
                           kv_cache_memory_bytes=None if kv_cache_mb is None else kv_cache_mb << 20,
                           tensor_parallel_size=tensor_parallel,
                           logprobs_mode="processed_logprobs",
                           # keep: no request may reuse KV another computed (it could be any versions old)
                           enable_prefix_caching=swap_kv == "recompute",
                           worker_extension_cls="rlbus.explorer.worker_ext.WeightSyncExtension")
        self.tokenizer = self.llm.get_tokenizer()
        self.threads = threads  # the CPU threads it computes on, with its core inline (else 0: not this process's)
        self.model = model
        self.version = version
        self.llm.llm_engine.set_weight_version(str(version))  # every step's output carries it
        self.last_load: dict = {}  # how the current version arrived: {version, method, seconds}
        self.busy_s = 0.0  # time spent in engine steps that had requests to run
        self.paused_s = 0.0  # time generation stood still for weight loads
        self._lock = threading.Lock()
        self._loading = threading.Event()  # a reload is waiting for the lock
        self.sequence_s = 0.0  # the integral over busy time of the sequences being generated
        self._requests: dict[str, int] = {}  # submitted, not yet returned by step: id -> samples
        self._finished: dict[str, list[Completion]] = {}  # finished while someone else was stepping
        self._ids = itertools.count()
        log.info("engine_started", model=model, dtype=dtype, core="inline" if self.inline else "process",
                 threads=threads or None,
                 seconds=round(time.monotonic() - started, 2))
        if without_chat_template(self.tokenizer):
            log.warning("no_chat_template", model=model, hint="a model without a chat template (a base model): "
                        "each task's prompt goes to it as plain text; multi-turn tasks need a template")

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation through the model's chat template, ready for the reply; for a model without
        one (a base model), its messages' text as it stands, one after the other."""
        if without_chat_template(self.tokenizer):
            return list(self.tokenizer.encode("\n\n".join(m["content"] for m in messages)))
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet returned by `step`."""
        return len(self._requests)

    @property
    def sequences(self) -> int:
        """Samples still being generated: vLLM runs a request of n samples as n sequences, and each leaves the
        engine as it ends, while the request is returned only once all n have."""
        return self.llm.llm_engine.get_num_unfinished_requests()

    def submit(self, request_id: str, prompt: Sequence[int], n: int = 1, temperature: float = 1.0,
               top_p: float = 1.0, max_tokens: int = 64, stop_token_ids: list[int] | None = None) -> None:
        """Start generating `n` samples of `prompt`; `step` returns them, under `request_id`, once all are done."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0,
                                stop_token_ids=stop_token_ids, output_kind=RequestOutputKind.FINAL_ONLY)
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in flight")
        with self._lock:
            self.llm.llm_engine.add_request(request_id, {"prompt_token_ids": list(prompt)}, params)
        self._requests[request_id] = n

    def step(self) -> dict[str, list[Completion]]:
        """One engine step; returns the requests finished since the last call, by id, samples in order."""
        done, self._finished = self._finished, {}
        running = sum(n for rid, n in self._requests.items() if rid not in done)
        if running:
            while self._loading.is_set():  # a load waits for the lock: let it in (a Lock is not fair)
                time.sleep(0.001)
            with self._lock:
                sequences = self.sequences
                started = time.monotonic()
                outputs = self.llm.llm_engine.step()
                elapsed = time.monotonic() - started
            self.busy_s += elapsed
            self.sequence_s += sequences * elapsed
            for out in outputs:
                if out.finished:
                    done[out.request_id] = [_completion(c) for c in sorted(out.outputs, key=lambda c: c.index)]
        for rid in done:
            self._requests.pop(rid, None)
        return done

    def generate(self, prompts: Sequence[Sequence[int]], n: int, temperature: float = 1.0, top_p: float = 1.0,
                 max_tokens: int = 64, stop_token_ids: list[int] | None = None) -> list[list[Completion]]:
        """`n` samples of each prompt, in order. Requests others have in flight advance too; what they finish
        meanwhile is kept for their next `step`."""
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        for rid, prompt in zip(ids, prompts):
            self.submit(rid, prompt, n, temperature, top_p, max_tokens, stop_token_ids)
        mine: dict[str, list[Completion]] = {}
        others: dict[str, list[Completion]] = {}
        while len(mine) < len(ids):
            for rid, samples in self.step().items():
                (mine if rid in ids else others)[rid] = samples
        self._finished.update(others)  # handed to their owner's next step
        self._requests.update({rid: len(samples) for rid, samples in others.items()})
        return [mine[rid] for rid in ids]

    def warm_up(self) -> None:
        """The first generation after start is slow on CPU; pay for it before the first real batch."""
        started = time.monotonic()
        self.generate([self.chat_prompt([{"role": "user", "content": "Hi"}])], n=2, max_tokens=4)
        log.info("engine_warmed_up", seconds=round(time.monotonic() - started, 2))

    def reload(self, source: dict, version: int) -> dict:
        """Load the weights of a weight-sync source in place, in every worker (rlbus.weights.sync decides
        which source; the workers turn it into tensors). Returns what the load measured."""
        engine = self.llm.llm_engine
        self._loading.set()
        with self._lock:
            self._loading.clear()
            started = time.monotonic()
            engine.sleep(level=0, mode="keep")  # the scheduler pauses; requests in flight stay where they are
            try:
                info = self.llm.collective_rpc("rlbus_reload", args=(source,))[0]
                engine.set_weight_version(str(version))
                if self.swap_kv == "recompute":
                    # No later token may come from KV that the old weights computed: empty the prefix cache and
                    # send the running requests back to be recomputed (prompt and tokens so far) under the new.
                    engine.reset_prefix_cache(reset_running_requests=True)
                seconds = round(time.monotonic() - started, 3)
                # How this version arrived is set before the version itself: a thread that sees the new version
                # (the explorer's loop, a status reader) never sees the previous version's load beside it.
                self.last_load = {"version": version, "method": source["method"], "seconds": seconds,
                                  "in_flight": len(self._requests)}
                self.version = version
            finally:
                engine.wake_up(tags=["scheduling"])
        self.paused_s += time.monotonic() - started
        where = ({"epoch": source["announcement"]["epoch"]} if source["method"] == "nccl"
                 else {"path": source.get("path")})
        metrics.emit("weights_loaded", policy_version=version, method=source["method"], seconds=seconds, **where,
                 in_flight=len(self._requests),
                 **{k: round(v, 3) if isinstance(v, float) else v for k, v in info.items()})
        return info

    def close(self, ending: bool = False) -> None:
        """Stop vLLM's engine core (its process, when it has one: without this the interpreter waits for it
        at exit). `ending`: this process ends next; its heap stays frozen through vLLM's shutdown
        (`heap_kept_frozen`), and what the shutdown made is frozen after it, so that the interpreter's teardown
        walks none of it (`refreeze_heap`). The event says how long the close took and what stayed frozen."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            started = time.monotonic()
            with heap_kept_frozen() if ending else nullcontext():
                llm.llm_engine.engine_core.shutdown()
            remove_sockets(self._sockets)
            log.info("engine_stopped", model=self.model, seconds=round(time.monotonic() - started, 2),
                     frozen=gc.get_freeze_count())
        if ending:
            refreeze_heap()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _completion(c) -> Completion:
    """One finished completion, with the version of each run of its tokens."""
    ids = list(c.token_ids)
    logprobs = [step[tok].logprob for tok, step in zip(ids, c.logprobs or [])]
    if len(logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(ids)} tokens")
    spans = [(s.start, int(s.version)) for s in (c.weight_versions or []) if s.end > s.start]
    return Completion(ids, logprobs, c.finish_reason or "unknown", c.text, spans)

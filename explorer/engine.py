"""The explorer's vLLM engine: sampling with behaviour logprobs, and in-place weight loads.

One `vllm.LLM` per explorer process. `generate` takes prompt token ids and
returns, for each prompt, `n` samples with their token ids, the logprob of
every sampled token under the distribution it was sampled from
(`logprobs_mode="processed_logprobs"`: after temperature and top-p), the
finish reason and the text. `reload` loads a version into the running
engine from a weight-sync source (rlbus.weights.sync chooses it and checks
digests) through the worker extension, and only then moves `version`: a
generation never starts on half-loaded weights, and none is dropped around a
load (the two take turns on one lock).

vLLM spawns processes: create an Engine only under `if __name__ == "__main__"`
or in a process started by the CLI.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import structlog

from rlbus.explorer.lifeline import owning_engines

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
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str


class Engine:
    def __init__(self, model: str, *, dtype: str = "bfloat16", seed: int = 0, max_model_len: int = 1024,
                 memory_fraction: float = 0.3, enforce_eager: bool = True, version: int = 0,
                 core: str = "auto"):
        started = time.monotonic()
        self.inline = inline_core(core)
        if self.inline:
            # vLLM reads this when the engine is built: its engine core and worker then run in this process.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        with owning_engines():  # its processes end when this one does, even by SIGKILL
            self.llm = LLM(model=model, dtype=dtype, seed=seed, max_model_len=max_model_len,
                           gpu_memory_utilization=memory_fraction, enforce_eager=enforce_eager,
                           logprobs_mode="processed_logprobs",
                           worker_extension_cls="rlbus.explorer.worker_ext.WeightSyncExtension")
        self.tokenizer = self.llm.get_tokenizer()
        self.model = model
        self.version = version
        self.last_load: dict = {}  # how the current version arrived: {version, method, seconds}
        self._lock = threading.Lock()
        log.info("engine_started", model=model, dtype=dtype, core="inline" if self.inline else "process",
                 seconds=round(time.monotonic() - started, 2))

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation through the model's chat template, ready for the reply."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def generate(self, prompts: Sequence[Sequence[int]], n: int, temperature: float = 1.0, top_p: float = 1.0,
                 max_tokens: int = 64, stop_token_ids: list[int] | None = None) -> list[list[Sample]]:
        from vllm import SamplingParams

        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0,
                                stop_token_ids=stop_token_ids)
        with self._lock:
            outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        groups = []
        for out in outputs:
            samples = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                logprobs = [step[tok].logprob for tok, step in zip(ids, c.logprobs or [])]
                if len(logprobs) != len(ids):
                    raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(ids)} tokens")
                samples.append(Sample(ids, logprobs, c.finish_reason or "unknown", c.text))
            groups.append(samples)
        return groups

    def warm_up(self) -> None:
        """The first generation after start is slow on CPU; pay for it before the first real batch."""
        started = time.monotonic()
        self.generate([self.chat_prompt([{"role": "user", "content": "Hi"}])], n=2, max_tokens=4)
        log.info("engine_warmed_up", seconds=round(time.monotonic() - started, 2))

    def reload(self, source: dict, version: int) -> dict:
        """Load the weights of a weight-sync source in place, in every worker (rlbus.weights.sync decides
        which source; the workers turn it into tensors). Returns what the load measured."""
        started = time.monotonic()
        with self._lock:
            info = self.llm.collective_rpc("rlbus_reload", args=(source,))[0]
            self.version = version
        seconds = round(time.monotonic() - started, 3)
        self.last_load = {"version": version, "method": source["method"], "seconds": seconds}
        where = ({"epoch": source["announcement"]["epoch"]} if source["method"] == "nccl"
                 else {"path": source.get("path")})
        log.info("weights_loaded", policy_version=version, method=source["method"], seconds=seconds, **where,
                 **{k: round(v, 3) if isinstance(v, float) else v for k, v in info.items()})
        return info

    def close(self) -> None:
        """Stop vLLM's engine core (its process, when it has one: without this the interpreter waits for it
        at exit)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            log.info("engine_stopped", model=self.model)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

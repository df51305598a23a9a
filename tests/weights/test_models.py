"""`model_fingerprint`: what HELLO's `rollout.model` carries, so that one run samples and trains one model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlbus.common.config import ConfigError
from rlbus.weights.models import make_tiny, model_fingerprint, resolve_model


def copy_written_apart(src: str, dst: Path) -> Path:
    """The same model as another host may hold it: its JSON files written again, in another order and layout,
    and its config with a field a newer library adds."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.pop("head_dim", None)
    (dst / "config.json").write_text(json.dumps(dict(reversed(list(config.items()))), indent=4))
    tok = json.loads((dst / "tokenizer.json").read_text())
    tok["model"]["vocab"] = dict(reversed(list(tok["model"]["vocab"].items())))
    tok["added_tokens"] = list(reversed(tok["added_tokens"]))
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


def test_one_model_written_apart_has_one_fingerprint_and_another_model_another(tiny_model, tmp_path):
    print_ = model_fingerprint(tiny_model)
    assert print_.startswith("LlamaForCausalLM 2x128 vocab 49152 #") and len(print_.split("#")[1]) == 12
    assert model_fingerprint(str(copy_written_apart(tiny_model, tmp_path / "copy"))) == print_
    # Other weights of the same shapes (another seed): the same; the explorers load the trainer's at the first sync.
    assert model_fingerprint(str(make_tiny(tmp_path / "reseeded", tiny_model, seed=7))) == print_
    wider = model_fingerprint(str(make_tiny(tmp_path / "wider", tiny_model, hidden=192)))
    assert wider.startswith("LlamaForCausalLM 2x192 vocab 49152 #")
    deeper = model_fingerprint(str(make_tiny(tmp_path / "deeper", tiny_model, layers=3)))
    assert len({print_, wider, deeper}) == 3


def test_another_vocabulary_of_the_same_size_is_another_model(tiny_model, tmp_path):
    """Token ids that mean other tokens would make every trajectory's ids meaningless to the trainer."""
    other = shutil.copytree(tiny_model, tmp_path / "other")
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    assert model_fingerprint(str(other)) != model_fingerprint(tiny_model)


def test_a_multimodal_config_is_read_by_its_language_part(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["SomeForConditionalGeneration"],
        "text_config": {"hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 100, "num_attention_heads": 1}}))
    assert model_fingerprint(str(tmp_path)).startswith("SomeForConditionalGeneration 4x64 vocab 100 #")


def test_a_model_whose_files_are_not_here_has_no_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache: nothing downloaded
    assert model_fingerprint("someone/not-downloaded") == ""
    assert model_fingerprint("") == ""  # a stand-in engine's
    assert model_fingerprint(str(tmp_path)) == ""  # a directory without config.json


def test_a_model_directory_is_one_with_a_config_and_weights(tiny_model, tmp_path):
    """vLLM and transformers each said a directory without weights in a traceback of their own."""
    assert resolve_model(tiny_model) == str(Path(tiny_model).resolve())
    with pytest.raises(ConfigError, match="without config.json"):
        resolve_model(str(tmp_path))
    shutil.copy(f"{tiny_model}/config.json", tmp_path)
    with pytest.raises(ConfigError, match=r"has a config.json but no weight files \(.safetensors, .bin"):
        resolve_model(str(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    assert resolve_model(str(tmp_path)) == str(tmp_path.resolve())

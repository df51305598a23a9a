"""A published weight version is readable as every other file rlbus writes: by the modes its umask allows."""

from __future__ import annotations

import os

import pytest

from rlbus.weights.checkpoint import CheckpointSender, umask


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_a_published_versions_files_take_the_mode_the_umask_gives(tiny_model, tmp_path, mask):
    """safetensors writes 0600 whatever the umask: an explorer or an evaluation running as another user on a
    shared file system could not read the weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    before = os.umask(mask)
    try:
        assert umask() == mask
        sender = CheckpointSender(tmp_path / "weights", tiny_model, dtype=torch.float32)
        sender.publish(sender.snapshot(model), 1, 0)
    finally:
        os.umask(before)
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in (tmp_path / "weights" / "v1").iterdir()}
    assert "model.safetensors" in modes and "tokenizer.json" in modes
    assert modes == dict.fromkeys(modes, oct(0o666 & ~mask))

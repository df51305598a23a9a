"""The sharded trainer on GPUs: FSDP2 over NCCL takes the steps of the single process on the same batches.

Run on a host with NVIDIA GPUs (one for the first test, two for the second), no vLLM needed:

    .venv/bin/python -m pytest -m gpu tests/trainer/test_sharded_gpu.py

Here, without a GPU, every test skips and says why.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import free_port
from tests.helpers.weights import assert_same_weights
from tests.trainer.test_resume import delivered, feed
from tests.trainer.test_sharded import SETS, assert_same_step, step_metrics, train

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CUDA = ("trainer.device=cuda", "trainer.deterministic=true")


def compare(broker_factory, clients, tiny_model, tmp_path, world: int, env: dict | None = None) -> None:
    one, many = broker_factory(*SETS), broker_factory(*SETS)
    for b in (one, many):
        feed(b, clients, steps=3)
    train(one, tmp_path / "one", tiny_model, tmp_path / "one.jsonl", 1, 3, 2, *CUDA)
    train(many, tmp_path / "many", tiny_model, tmp_path / "many.jsonl", world, 3, 2, *CUDA, env=env)
    assert delivered(one) == delivered(many)
    for step in range(3):
        assert_same_step(step_metrics(tmp_path / "many.jsonl", step), step_metrics(tmp_path / "one.jsonl", step))
    w1 = load_file(tmp_path / "one" / "weights" / "v3" / "model.safetensors")
    wn = load_file(tmp_path / "many" / "weights" / "v3" / "model.safetensors")
    assert_same_weights(wn, w1, lr=1e-3)


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU (none here)")
def test_one_rank_on_nccl_takes_the_single_process_steps(broker_factory, clients, tiny_model, tmp_path):
    # One rank as torchrun starts it: the NCCL process group, FSDP2 and the gathering publish, on one GPU.
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    compare(broker_factory, clients, tiny_model, tmp_path, 1, env=env)


@pytest.mark.skipif(GPUS < 2, reason=f"needs two CUDA GPUs ({GPUS} here)")
def test_two_ranks_on_nccl_take_the_single_process_steps(broker_factory, clients, tiny_model, tmp_path):
    compare(broker_factory, clients, tiny_model, tmp_path, 2)

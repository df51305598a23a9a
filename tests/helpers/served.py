"""Published versions of a small model and their weight-state messages, for the weight server's tests."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from rlbus.weights.digest import weights_digest

CHUNK_BYTES = 64 << 10


def publish_versions(root: Path, count: int, changed: float = 0.01, seed: int = 0) -> dict[int, str]:
    """Versions v1..v{count} of a small model: each changes `changed` of the bf16 values a little."""
    g = torch.Generator().manual_seed(seed)
    state = {"embed": torch.randn(512, 256, generator=g).to(torch.bfloat16),
             "layer.weight": torch.randn(256, 256, generator=g).to(torch.bfloat16),
             "norm": torch.ones(256, dtype=torch.float32)}
    digests = {}
    for v in range(1, count + 1):
        if v > 1:
            for t in state.values():
                flat = t.view(-1)
                idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(flat.numel() * changed))]
                flat[idx] += (1e-2 * torch.randn(len(idx), generator=g)).to(t.dtype)
        d = root / f"v{v}"
        d.mkdir(parents=True)
        save_file(state, str(d / "model.safetensors"))
        (d / "config.json").write_text('{"model_type": "tiny"}')
        digests[v] = weights_digest(d)
    return digests


def state_of(server, root: Path, digests: dict[int, str], version: int, location: Path | None = None):
    """The weight state the bus would announce for `version` published under `root` and served by `server`."""
    return {"version": version, "method": "checkpoint", "digest": digests[version], "step": version,
            "location": str(location or root / f"v{version}"), "fetch_from": server.address}

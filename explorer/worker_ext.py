"""Code that runs inside vLLM's worker processes.

vLLM loads this class as a mixin of its worker (`worker_extension_cls`), so
its methods can be called from the explorer with `LLM.collective_rpc`. They
load new weights in place, into the model the engine already holds, so the
engine never restarts between policy versions.
"""

from __future__ import annotations

import time
from pathlib import Path


class WeightSyncExtension:
    """Mixed into vLLM's worker; `self` is the worker."""

    def rlbus_load_checkpoint(self, path: str) -> int:
        """Load every tensor of the safetensors files under `path` in place; returns how many."""
        from safetensors.torch import safe_open

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path}")
        count = 0

        def tensors():
            nonlocal count
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        count += 1
                        yield name, f.get_tensor(name)

        self.model_runner.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)
        self._rlbus_refresh_tied_head()
        return count

    def rlbus_receive_broadcast(self, announcement: dict, rank: int) -> dict:
        """Receive one version broadcast in the announced epoch and load it in place.

        The worker keeps its place in the epoch (communicator and buckets)
        between versions and builds a new one when the epoch changes. Nothing
        is loaded unless every bucket arrived and the digest matches; on any
        failure the place is dropped, so the next announcement starts clean.
        """
        from rlbus.weights.broadcast import Member

        member = getattr(self, "_rlbus_member", None)
        if member is not None and member.key != (announcement["address"], announcement["epoch"]):
            member.close()
            member = self._rlbus_member = None
        started = time.monotonic()
        try:
            if member is None:
                device = str(getattr(self, "device", "")) or None
                member = self._rlbus_member = Member(dict(announcement, rank=rank),
                                                     device=device if device and device.startswith("cuda") else None)
            joined = time.monotonic()
            seconds = member.receive(announcement["version"], announcement["digest"])
        except Exception:
            if member is not None:
                member.close()
            self._rlbus_member = None
            raise
        loaded = time.monotonic()
        self.model_runner.reload_weights(weights_iterator=member.layout.views(member.buckets),
                                         is_checkpoint_format=True)
        self._rlbus_refresh_tied_head()
        return dict(seconds, join_s=joined - started, reload_s=time.monotonic() - loaded,
                    tensors=len(member.layout.entries))

    def _rlbus_refresh_tied_head(self) -> None:
        """Make a tied LM head follow the reloaded embedding.

        With tied embeddings the checkpoint has no lm_head tensor, so the
        layer-wise reload never touches the head; on CPU the head also keeps a
        prepacked GEMM copy of the old embedding. Re-tie it and rebuild that
        copy (found in vLLM 0.32: without this, logits after a reload come from
        the old embedding).
        """
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        config = getattr(model, "config", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None or not getattr(config, "tie_word_embeddings", False):
            return
        head.weight = embed.weight
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)

"""Code that runs inside vLLM's worker processes.

vLLM loads this class as a mixin of its worker (`worker_extension_cls`), so
its methods can be called from the explorer with `LLM.collective_rpc`. They
load new weights in place, into the model the engine already holds, so the
engine never restarts between policy versions.
"""

from __future__ import annotations

import time


class WeightSyncExtension:
    """Mixed into vLLM's worker; `self` is the worker."""

    def rlbus_reload(self, source: dict) -> dict:
        """Load the weights of `source` (a weight-sync source: rlbus.weights.sync) in place; returns what the
        source measured, and the reload's own seconds."""
        from rlbus.weights.sync import open_source

        tensors, info = open_source(source, self)
        started = time.monotonic()
        self.model_runner.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)
        self._rlbus_refresh_tied_head()
        info["reload_s"] = time.monotonic() - started
        return info

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

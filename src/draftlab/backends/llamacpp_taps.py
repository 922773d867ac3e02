"""The inputs of chosen target layers, recorded by llama.cpp itself at every decode of one context (what EAGLE-3
drafts read): `LlamaCppSequences` taps through it, for one sequence (`LlamaCppBackend`) or a KV stream per slot.

llama.cpp records them with the calls its own `draft-eagle3` speculation uses (`layer_input_calls`); the graph only
marks those tensors as outputs, so the logits are those of a decode without them. It keeps every token's row of the
decode, whatever logits were asked for, in the batch's order (a batch split into ubatches, as a batch of several
streams is, is put back in order): row i is the i-th token given to `llama_decode`.
"""

from __future__ import annotations

import numpy as np
import torch

from draftlab.backends.gguf import INSTALL_HINT, LlamaCppModel, layer_input_calls
from draftlab.errors import DraftlabError

# Model types whose llama.cpp graph hands over its layers' inputs in draftlab's build (llama's own; qwen2's through
# scripts/build-llama-cpp.sh's hook): llama.cpp aborts the process on a tap of any other graph.
TAPPED_MODEL_TYPES = ("llama", "qwen2")


class LayerTaps:
    """The layers whose inputs one llama.cpp context records at every decode."""

    def __init__(self, lib, model: LlamaCppModel, ctx) -> None:
        self.lib, self.model, self.ctx = lib, model, ctx
        self._calls = layer_input_calls()
        self.available = self._calls is not None  # a library with the calls
        self.layers: tuple[int, ...] = ()

    def set(self, taps: tuple[int, ...]) -> None:
        """Record the inputs of exactly these layers at every decode from now on (a one-line error for layers the
        model or its graph cannot hand over)."""
        if taps == self.layers:
            return
        if taps and not self.available:
            raise DraftlabError(f"this llama.cpp library hands over no layer inputs; {INSTALL_HINT}")
        model_type = self.model.config.model_type
        if taps and model_type not in TAPPED_MODEL_TYPES:
            raise DraftlabError(f"llama.cpp's {model_type} graph hands over no layer inputs (drafts reading the "
                                f"target's layers run on targets of types {', '.join(TAPPED_MODEL_TYPES)})")
        if any(not 0 <= layer < self.model.n_layer for layer in taps):
            raise DraftlabError(f"{self.model.path.name} has layers 0-{self.model.n_layer - 1}, not {list(taps)}")
        for layer in self.layers:
            self._calls.enable(self.ctx, layer, False)
        for layer in taps:
            self._calls.enable(self.ctx, layer, True)
        self.layers = taps

    def read(self, rows: int) -> torch.Tensor | None:
        """The last decode's inputs of the tapped layers [rows, len(taps) * D] in batch order; None untapped."""
        if not self.layers:
            return None
        width = self.lib.llama_model_n_embd(self.model.handle)
        parts = [np.ctypeslib.as_array(self._calls.read(self.ctx, layer), shape=(rows, width))
                 for layer in self.layers]  # each [rows, D], llama.cpp's buffer
        return torch.from_numpy(np.concatenate(parts, axis=1))  # [rows, len(taps) * D], a copy

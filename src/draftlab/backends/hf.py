"""Any transformers causal LM as a backend, with a `DynamicCache` (batch size 1).

Tree blocks are scored with a custom 4D additive attention mask (transformers
passes a 4D mask through unchanged) and explicit position ids; `keep` gathers
the accepted entries of every layer's key/value tensors.
"""

from __future__ import annotations

from typing import Sequence

import torch

from draftlab.backends.base import ROUNDING, all_rows, greedy_rows, is_prefix
from draftlab.backends.numerics import checked_rows
from draftlab.decoding.step import Block, Scores


class HFBackend:
    """A transformers causal LM with a DynamicCache, batch size 1."""

    provides_hidden = True  # from output_hidden_states: the last entry is after the final norm
    greedy_chain = greedy_rows  # a draft's greedy tokens, one `score` each

    def __init__(self, model: torch.nn.Module, device: torch.device | str = "cpu",
                 batch_invariant: bool | None = None, head_rows: torch.Tensor | None = None) -> None:
        """`batch_invariant` is accepted for the registry's sake; transformers' forward is never batch-invariant.

        `head_rows` [V']: return logits for these vocabulary rows only (cut from the full logits, so the same
        numbers and no saving; the fast backend computes only those rows).
        """
        self.model = model
        self.batch_invariant = False
        self.numerics = f"transformers' forward ({ROUNDING}: rows of a block round differently from single rows)"
        self.device = torch.device(device)
        vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._rows = None if head_rows is None else checked_rows(head_rows, vocab_size)  # [V']
        self.vocab_size = vocab_size if self._rows is None else len(self._rows)
        self._cache = None
        self._len = 0
        self._block_start = 0

    @property
    def cache_len(self) -> int:
        """Number of tokens currently held in the cache."""
        return self._len

    def reset(self) -> None:
        """Empty the cache."""
        from transformers import DynamicCache

        self._cache = DynamicCache(config=self.model.config)
        self._len = 0

    @torch.inference_mode()
    def score(self, token_ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Append consecutive tokens to the cache; logits [n, V] (or [1, V] if last_only), fp32."""
        positions = torch.arange(self._len, self._len + len(token_ids), device=self.device)  # [n]
        logits, _ = self._forward(token_ids, positions, None, last_only, with_hidden=False)
        return logits

    @torch.inference_mode()
    def score_block(self, block: Block, with_hidden: bool = False, last_only: bool = False,
                    taps: tuple[int, ...] = ()) -> Scores:
        """Append a tree-shaped block in one pass; logits [n, V] ([1, V] if last_only), hidden states if asked (final
        [n, D], or the inputs of layers `taps` concatenated [n, len(taps) * D])."""
        layout = block.layout()
        positions = (self._len + layout.depths).to(self.device)  # [n]
        mask = None if block.is_chain else self._tree_mask(layout.ancestors)
        logits, hidden = self._forward(block.tokens, positions, mask, last_only, with_hidden, taps)
        return Scores(logits, hidden)

    def keep(self, indices: Sequence[int]) -> None:
        """Keep the cache before the last block plus the block's entries at `indices`."""
        if is_prefix(indices):
            self.rollback(self._block_start + len(indices))
            return
        rows = torch.tensor([self._block_start + i for i in indices], device=self.device)  # [m]
        for layer in self._cache.layers:
            layer.keys = torch.cat([layer.keys[:, :, : self._block_start], layer.keys[:, :, rows]], dim=2)
            layer.values = torch.cat([layer.values[:, :, : self._block_start], layer.values[:, :, rows]], dim=2)
        self._len = self._block_start + len(indices)

    def row_check(self) -> str:
        """Nothing checked op by op here: this backend's numerics already say what its rows promise."""
        return ""

    def exact_rows(self, block: Block) -> set[int]:
        """Every row: transformers' rows never equal single rows bitwise, chains included, so scoring a tree's
        path again as a chain would bring it no closer to plain decoding."""
        return all_rows(block)

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        if length < self._len:
            self._cache.crop(length - self._len)  # transformers 5 takes minus the tokens to drop
            self._len = length

    def synchronize(self) -> None:
        """Wait for queued device work."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _forward(self, token_ids, positions, mask, last_only: bool, with_hidden: bool, taps: tuple[int, ...] = ()):
        """Run the model on new tokens at `positions` [n]; logits [n, V] fp32 CPU, hidden [n, D or len(taps) D] or
        None (transformers' hidden_states[i] is the input of layer i; its last entry is after the final norm)."""
        if self._cache is None:
            self.reset()
        self._block_start = self._len
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, n]
        out = self.model(
            input_ids=input_ids,
            past_key_values=self._cache,
            use_cache=True,
            position_ids=positions.unsqueeze(0),
            attention_mask=mask,
            logits_to_keep=1 if last_only else 0,
            output_hidden_states=with_hidden,
        )
        self._len += input_ids.shape[1]
        hidden = None
        if with_hidden:
            layers = [out.hidden_states[i][0] for i in taps] if taps else [out.hidden_states[-1][0]]
            hidden = torch.cat(layers, dim=-1)  # [n, D] or [n, len(taps) * D]
        logits = out.logits[0].float().cpu()  # [n, V]; verification runs on the CPU
        return (logits if self._rows is None else logits[:, self._rows]), hidden  # [n, V or V']

    def _tree_mask(self, ancestors: torch.Tensor) -> torch.Tensor:
        """Additive mask [1, 1, n, cache + n]: every cached token, plus each token's ancestors and itself."""
        n = ancestors.shape[0]
        visible = torch.cat([torch.ones(n, self._len, dtype=torch.bool), ancestors], dim=1)  # [n, cache + n]
        dtype = self.model.dtype
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
        return mask[None, None].to(self.device)

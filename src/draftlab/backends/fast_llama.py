"""A lean forward pass for Llama-family models, with a static KV cache.

Why: on a CPU a 135M model is memory bound; its matrix products take ~21 ms a
token, but transformers' eager forward adds ~14 ms of per-module overhead
(mask building, attention dispatch, cache concatenation). This backend runs the
same weights (read from the loaded HF module, never modified)
through plain tensor code:

- q/k/v and gate/up projections concatenated once (a copy of those weights,
  made at construction), so each layer runs 4 matrix products instead of 7.

- KV cache preallocated per layer as [kv_heads, capacity, head_dim]; writing at
  `cache_len` and rolling back by moving `cache_len` (stale entries beyond it are
  never read and are overwritten later), as gpt-fast does.
- RoPE tables from the model's own rotary module, so every RoPE variant that
  transformers implements gives the same angles.
- SDPA with grouped-query attention; a causal mask only when more than one
  token is scored, a tree mask (cache + ancestors) for tree-shaped blocks;
  `keep` compacts an accepted tree path in place.

It implements the `Backend` protocol; the registry (`draftlab.backends`) picks
it for the model types in `SUPPORTED_MODEL_TYPES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from draftlab.backends.base import is_prefix
from draftlab.backends.numerics import causal_mask, rms_norm, rope, tree_mask
from draftlab.errors import DraftlabError
from draftlab.step import Block, Scores

SUPPORTED_MODEL_TYPES = ("llama",)


class FastLlamaBackend:
    """Batch-1 Llama decoding with a static, rollback-by-length KV cache."""

    provides_hidden = True  # score_block(..., with_hidden=True) also returns the final hidden states

    def __init__(self, model: torch.nn.Module, device: torch.device | str = "cpu", capacity: int = 1024) -> None:
        config = model.config
        self.model = model
        self.device = torch.device(device)
        self.layers = list(model.model.layers)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.max_positions = config.max_position_embeddings
        self.dtype = model.model.embed_tokens.weight.dtype
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._keys: list[torch.Tensor] = []  # per layer [kv_heads, capacity, head_dim]
        self._values: list[torch.Tensor] = []
        self._cos = self._sin = torch.empty(0)  # [capacity, head_dim]
        self._len = 0
        self._block_start = 0  # where the last scored block began
        self._head_split = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
        self._weights = [_fuse(layer) for layer in self.layers]
        self._allocate(capacity)

    @property
    def cache_len(self) -> int:
        """Number of tokens currently held in the cache."""
        return self._len

    def reset(self) -> None:
        """Empty the cache (the buffers are kept)."""
        self._len = 0

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        self._len = min(self._len, length)

    def synchronize(self) -> None:
        """Wait for queued device work."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def score(self, token_ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Append consecutive tokens to the cache; logits [n, V] (or [1, V] if last_only), fp32 on the CPU."""
        start, n = self._len, len(token_ids)
        positions = torch.arange(start, start + n, device=self.device)  # [n]
        hidden = self._forward(token_ids, positions, causal_mask(start, n, self.device))  # [n, D]
        return self._logits(hidden[-1:] if last_only else hidden)

    @torch.inference_mode()
    def score_block(self, block: Block, with_hidden: bool = False, last_only: bool = False) -> Scores:
        """Append a tree-shaped block in one pass; logits [n, V] ([1, V] if last_only), final hidden states [n, D] if asked."""
        start, n = self._len, len(block.tokens)
        if block.is_chain:  # the chain's own code path: no tree bookkeeping, causal mask
            positions = torch.arange(start, start + n, device=self.device)  # [n]
            mask = causal_mask(start, n, self.device)
        else:
            layout = block.layout()
            positions = (start + layout.depths).to(self.device)  # [n]
            mask = tree_mask(start, layout.ancestors, self.device)  # [n, start + n]
        hidden = self._forward(block.tokens, positions, mask)
        return Scores(self._logits(hidden[-1:] if last_only else hidden), hidden if with_hidden else None)

    def keep(self, indices: Sequence[int]) -> None:
        """Keep the cache before the last block plus the block's entries at `indices`, compacted in order."""
        start = self._block_start
        if not is_prefix(indices):
            rows = torch.tensor([start + i for i in indices], device=self.device)  # [m]
            for keys, values in zip(self._keys, self._values):
                keys[:, start : start + len(indices)] = keys[:, rows]
                values[:, start : start + len(indices)] = values[:, rows]
        self._len = start + len(indices)

    def _forward(self, token_ids: Sequence[int], positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Run the layers on new tokens at `positions` [n], appended to the cache; final hidden states [n, D]."""
        n = len(token_ids)
        start, end = self._len, self._len + n
        if end > self._keys[0].shape[1]:
            self._allocate(min(max(2 * end, 256), self.max_positions))
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)  # [n]
        hidden = F.embedding(ids, self.model.model.embed_tokens.weight)  # [n, D]
        cos, sin = self._cos[positions], self._sin[positions]  # [n, head_dim]
        for index, layer in enumerate(self.layers):
            hidden = self._layer(index, layer, hidden, cos, sin, mask, start, end)
        self._block_start, self._len = start, end
        return rms_norm(hidden, self.model.model.norm.weight, self.eps)  # [n, D]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits [n, V], fp32 on the CPU, from final hidden states [n, D]."""
        return F.linear(hidden, self.model.get_output_embeddings().weight).float().cpu()

    def _layer(self, index, layer, hidden, cos, sin, mask, start, end) -> torch.Tensor:
        weights = self._weights[index]
        n = hidden.shape[0]
        normed = rms_norm(hidden, layer.input_layernorm.weight, self.eps)  # [n, D]
        qkv = F.linear(normed, weights.qkv, weights.qkv_bias)  # [n, (H + 2 Hkv) hd]
        query, key, value = qkv.view(n, -1, self.head_dim).transpose(0, 1).split(self._head_split)  # [heads, n, hd]
        query, key = rope(query, cos, sin), rope(key, cos, sin)
        self._keys[index][:, start:end] = key
        self._values[index][:, start:end] = value
        out = F.scaled_dot_product_attention(
            query.unsqueeze(0),  # [1, H, n, hd]
            self._keys[index][:, :end].unsqueeze(0),  # [1, Hkv, end, hd]
            self._values[index][:, :end].unsqueeze(0),
            attn_mask=mask,
            scale=layer.self_attn.scaling,
            enable_gqa=True,
        )[0]  # [H, n, hd]
        hidden = hidden + _linear(out.transpose(0, 1).reshape(n, -1), layer.self_attn.o_proj)
        normed = rms_norm(hidden, layer.post_attention_layernorm.weight, self.eps)
        gate, up = F.linear(normed, weights.gate_up).chunk(2, dim=-1)  # [n, I] each
        return hidden + _linear(F.silu(gate) * up, layer.mlp.down_proj)

    def _allocate(self, capacity: int) -> None:
        """(Re)allocate cache buffers and RoPE tables for `capacity` positions, keeping cached entries."""
        shape = (self.num_kv_heads, capacity, self.head_dim)
        keep = self._len
        self._keys = [self._grow(old, shape, keep) for old in self._keys] or [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers
        ]
        self._values = [self._grow(old, shape, keep) for old in self._values] or [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers
        ]
        positions = torch.arange(capacity, device=self.device)[None]  # [1, capacity]
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            cos, sin = self.model.model.rotary_emb(probe, positions)  # [1, capacity, head_dim]
        self._cos, self._sin = cos[0], sin[0]

    def _grow(self, old: torch.Tensor, shape, keep: int) -> torch.Tensor:
        new = torch.zeros(shape, dtype=self.dtype, device=self.device)
        new[:, :keep] = old[:, :keep]
        return new


@dataclass(frozen=True)
class _FusedWeights:
    """One layer's q/k/v and gate/up projections concatenated: one matmul each instead of 3 and 2."""

    qkv: torch.Tensor  # [(H + 2 Hkv) hd, D]
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor  # [2 I, D]


def _fuse(layer) -> _FusedWeights:
    """Concatenated copies of a layer's projection weights (the layer itself is not modified)."""
    attn, mlp = layer.self_attn, layer.mlp
    if mlp.gate_proj.bias is not None:
        raise DraftlabError("the fast backend does not support MLP biases; use --backend hf")
    biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
    qkv_bias = torch.cat(biases) if all(b is not None for b in biases) else None
    return _FusedWeights(
        torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach(),
        qkv_bias.detach() if qkv_bias is not None else None,
        torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
    )


def _linear(x: torch.Tensor, module: torch.nn.Linear) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)



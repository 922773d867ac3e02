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
  token is scored.

It implements the `Backend` protocol; `make_backend` picks it for
`model_type == "llama"` and falls back to `HFBackend` for everything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from draftlab.backend import HFBackend
from draftlab.errors import DraftlabError

SUPPORTED_MODEL_TYPES = ("llama",)


class FastLlamaBackend:
    """Batch-1 Llama decoding with a static, rollback-by-length KV cache."""

    provides_hidden = True  # score(..., with_hidden=True) also returns the final hidden states

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
    def score(self, token_ids: Sequence[int], last_only: bool = False, with_hidden: bool = False):
        """Append tokens to the cache; logits [n, V] (or [1, V] if last_only), fp32 on the CPU.

        with_hidden: also return the final hidden states [n, D] of every token (after the
        final norm: what the LM head reads), for drafters that read them.
        """
        n = len(token_ids)
        start, end = self._len, self._len + n
        if end > self._keys[0].shape[1]:
            self._allocate(min(max(2 * end, 256), self.max_positions))
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)  # [n]
        hidden = F.embedding(ids, self.model.model.embed_tokens.weight)  # [n, D]
        cos, sin = self._cos[start:end], self._sin[start:end]  # [n, head_dim]
        mask = self._causal_mask(start, n)  # [n, end] or None
        for index, layer in enumerate(self.layers):
            hidden = self._layer(index, layer, hidden, cos, sin, mask, start, end)
        self._len = end
        if with_hidden:
            hidden = _rms_norm(hidden, self.model.model.norm.weight, self.eps)  # [n, D]
            rows = hidden[-1:] if last_only else hidden
            return F.linear(rows, self.model.get_output_embeddings().weight).float().cpu(), hidden
        if last_only:
            hidden = hidden[-1:]
        hidden = _rms_norm(hidden, self.model.model.norm.weight, self.eps)
        return F.linear(hidden, self.model.get_output_embeddings().weight).float().cpu()  # [n, V]

    def _layer(self, index, layer, hidden, cos, sin, mask, start, end) -> torch.Tensor:
        weights = self._weights[index]
        n = hidden.shape[0]
        normed = _rms_norm(hidden, layer.input_layernorm.weight, self.eps)  # [n, D]
        qkv = F.linear(normed, weights.qkv, weights.qkv_bias)  # [n, (H + 2 Hkv) hd]
        query, key, value = qkv.view(n, -1, self.head_dim).transpose(0, 1).split(self._head_split)  # [heads, n, hd]
        query, key = _rope(query, cos, sin), _rope(key, cos, sin)
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
        normed = _rms_norm(hidden, layer.post_attention_layernorm.weight, self.eps)
        gate, up = F.linear(normed, weights.gate_up).chunk(2, dim=-1)  # [n, I] each
        return hidden + _linear(F.silu(gate) * up, layer.mlp.down_proj)

    def _causal_mask(self, start: int, n: int) -> torch.Tensor | None:
        """Boolean [n, start+n]: query i sees keys 0..start+i. None for a single token (it sees all)."""
        if n == 1:
            return None
        return torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril(diagonal=start)

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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm, computed in fp32 as transformers does."""
    if x.dtype != torch.float32:
        return weight * _rms_norm(x.float(), torch.ones((), device=x.device), eps).to(x.dtype)
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on [heads, n, hd] with cos/sin [n, hd] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


BACKENDS = ("auto", "fast", "hf")


def make_backend(model: torch.nn.Module, device: torch.device | str = "cpu", kind: str = "auto"):
    """A backend for `model`: "fast" (FastLlamaBackend), "hf" (HFBackend) or "auto" (fast where supported)."""
    if kind not in BACKENDS:
        raise DraftlabError(f"unknown backend {kind!r}; use one of {', '.join(BACKENDS)}")
    supported = getattr(model.config, "model_type", None) in SUPPORTED_MODEL_TYPES
    if kind == "fast" and not supported:
        raise DraftlabError(
            f"the fast backend supports model types {SUPPORTED_MODEL_TYPES}, not {model.config.model_type!r}; use --backend hf"
        )
    if kind != "hf" and supported:
        return FastLlamaBackend(model, device)
    return HFBackend(model, device)

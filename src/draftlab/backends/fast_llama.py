"""A lean forward pass for Llama-family models (Llama, Qwen2), with a static KV cache.

Why: on a CPU a 135M model is memory bound; its matrix products take ~21 ms a
token, but transformers' eager forward adds ~14 ms of per-module overhead
(mask building, attention dispatch, cache concatenation). This backend runs the
same weights (read from the loaded HF module, never modified) through plain tensor code:

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
- Exact by construction (a target's default, every dtype): every row of a
  scored block is bitwise the row that scoring its token alone after the same
  prefix gives. Matrix products run on fixed-size row chunks along the route
  measured fastest on this host (`draftlab.backends.routes`: `F.linear` or
  weight-major, chunks of 1-16 rows), norms and RoPE are per row already, and
  attention runs one query row at a time over exactly the keys it sees (the
  cache prefix, or for a tree its ancestors gathered in order).
- Prefill at full speed: a block scored for its last row only (a prompt) runs
  the fastest products and one attention call, since plain and speculative
  decoding prefill alike and its other rows are only cached.
- Drafts (not exact: their rounding never reaches the output) run the fastest
  products: weight-major blocks in fp32 on CPUs (`weight_major_linear`), so a
  block of 2-4 tokens costs about one token's products.
- Drafts and prefills in emulated bf16/fp16 (timed: a 16-row product costs over
  1.5x fp32's): a draft's single tokens and short blocks as they are, which reads
  half the bytes of fp32; prefills and trees of 6+ tokens with the weights
  converted to fp32 on the fly (`UpcastLinear`), where a bf16 block would cost
  one product per row.

It implements the `Backend` protocol; the registry (`draftlab.backends`) picks
it for the model types in `SUPPORTED_MODEL_TYPES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from draftlab.backends.base import ROUNDING, all_rows, is_prefix
from draftlab.backends.numerics import (
    INVARIANT_ROWS,
    UpcastLinear,
    attention_row,
    causal_mask,
    cut_head,
    invariant_linear,
    invariant_rms_norm,
    rms_norm,
    rope,
    tree_mask,
    weight_major_linear,
)
from draftlab.backends.routes import Route, default_route, dtype_label, upcast_pays
from draftlab.backends.row_check import check_ops
from draftlab.errors import DraftlabError
from draftlab.decoding.step import Block, Scores

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")  # qwen2: Llama with q/k/v biases


class FastLlamaBackend:
    """Batch-1 Llama decoding with a static, rollback-by-length KV cache."""

    provides_hidden = True  # score_block(..., with_hidden=True) also returns the final hidden states

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device | str = "cpu",
        capacity: int = 1024,
        batch_invariant: bool | None = None,
        invariant_rows: int | None = None,
        weight_major: bool | None = None,
        head_rows: torch.Tensor | None = None,
        upcast: bool | None = None,
        route: Route | None = None,
    ) -> None:
        """`batch_invariant`: score each block row bitwise as if alone (None: on, a target's default); drafts pass
        False and run the fastest products instead.

        `route`: the products blocks run (`draftlab.backends.routes`; its dtype must be the model's). None: for an
        exact backend the exact route measured fastest for this model's shapes and dtype on this host (cached);
        `invariant_rows` R asks for exact-linear/R instead.

        `weight_major`: a draft's blocks run as weight @ x^T (`weight_major_linear`; None: on for fp32 weights on a
        CPU, where `F.linear` on a few rows costs about one product per row).

        `head_rows` [V']: compute logits for these LM-head rows only (a draft with a cut vocabulary: the head of a
        small model with a large vocabulary is a large share of its weights); logits are then [n, V'].

        `upcast`: run a draft's blocks of 6+ rows and every prefill with the weights converted to fp32
        (`UpcastLinear`; None: on for bf16/fp16 weights where this host's 16-row products in that dtype, timed,
        cost over 1.5x fp32's: bf16 emulated, without AVX-512 BF16 or AMX).
        """
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
        self._head = cut_head(model.get_output_embeddings().weight, head_rows)  # [V or V', D]
        self.vocab_size = int(self._head.shape[0])
        self.route = self._route(route, batch_invariant, invariant_rows, config)
        self.batch_invariant = self.route is not None and self.route.exact
        self.weight_major = self._default_weight_major() if weight_major is None else weight_major
        self.upcast = upcast_pays(config, dtype_label(self.dtype), self.device.type) if upcast is None else upcast
        self._fast_products = self._draft_products()  # prefills (and drafts' blocks): the fastest products
        self._project = self._route_products() if self.route is not None else self._fast_products
        self._norm = partial(invariant_rms_norm, rows=self.route.rows) if self.batch_invariant else rms_norm
        self.numerics = (self.route.label if self.batch_invariant else
                         f"{self.route.label if self.route is not None else 'draft products'} ({ROUNDING})")
        self._keys: list[torch.Tensor] = []  # per layer [kv_heads, capacity, head_dim]
        self._values: list[torch.Tensor] = []
        self._cos = self._sin = torch.empty(0)  # [capacity, head_dim]
        self._len = 0
        self._block_start = 0  # where the last scored block began
        self._head_split = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
        self._weights = [_fuse(layer) for layer in self.layers]
        self._allocate(capacity)

    @property
    def invariant_rows(self) -> int:
        """The row chunk of an exact route's products (0 when not exact)."""
        return self.route.rows if self.route is not None else 0

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
        hidden, _ = self._forward(token_ids, positions, None, prefill=last_only and n > 1)  # [n, D]
        return self._logits(hidden[-1:] if last_only else hidden)

    @torch.inference_mode()
    def score_block(self, block: Block, with_hidden: bool = False, last_only: bool = False,
                    taps: tuple[int, ...] = ()) -> Scores:
        """Append a tree-shaped block in one pass; logits [n, V] ([1, V] if last_only), hidden states if asked: the
        final ones [n, D], or the inputs of layers `taps` concatenated [n, len(taps) * D]."""
        start, n = self._len, len(block.tokens)
        if block.is_chain:  # the chain's own code path: no tree bookkeeping, causal attention
            positions = torch.arange(start, start + n, device=self.device)  # [n]
            ancestors = None
        else:
            layout = block.layout()
            positions = (start + layout.depths).to(self.device)  # [n]
            ancestors = layout.ancestors
        prefill = last_only and n > 1 and ancestors is None
        hidden, tapped = self._forward(block.tokens, positions, ancestors, prefill, taps if with_hidden else ())
        logits = self._logits(hidden[-1:] if last_only else hidden)
        return Scores(logits, (tapped if taps else hidden) if with_hidden else None)

    @torch.inference_mode()  # the buffers may have been (re)allocated inside a forward, as inference tensors
    def keep(self, indices: Sequence[int]) -> None:
        """Keep the cache before the last block plus the block's entries at `indices`, compacted in order."""
        start = self._block_start
        if not is_prefix(indices):
            rows = torch.tensor([start + i for i in indices], device=self.device)  # [m]
            for keys, values in zip(self._keys, self._values):
                keys[:, start : start + len(indices)] = keys[:, rows]
                values[:, start : start + len(indices)] = values[:, rows]
        self._len = start + len(indices)

    def exact_rows(self, block: Block) -> set[int]:
        """Every row: a tree's rows are computed as its chains' would be (no re-verification needed)."""
        return all_rows(block)

    def _route(self, route: Route | None, batch_invariant: bool | None, invariant_rows: int | None, config
               ) -> Route | None:
        """The route blocks run: as given; None for a draft; else exact, measured on this host (cached)."""
        name = dtype_label(self.dtype)
        if route is not None:
            if route.dtype != name:
                raise DraftlabError(f"route {route.label} asked for a {name} model; load the model in {route.dtype}")
            return route
        if batch_invariant is False:
            return None
        if invariant_rows:
            return Route(name, "linear", invariant_rows)
        if self.device.type not in ("cpu", "cuda"):
            return Route(name, "linear", INVARIANT_ROWS)  # other accelerators: not timed; a 16-row product
        return default_route(config, name, str(self.device))

    def _default_weight_major(self) -> bool:
        return self.device.type == "cpu" and self.dtype == torch.float32

    def _route_products(self) -> Callable:
        """The matrix product a route runs: (x [n, D], weight [out, D], bias) -> [n, out]."""
        weight_major = self.route.kind == "weight-major"
        if self.route.exact:
            return partial(invariant_linear, rows=self.route.rows, weight_major=weight_major)
        return weight_major_linear if weight_major else F.linear

    def _draft_products(self) -> Callable:
        """The fastest products where rounding need not match single rows: drafts' blocks, prefills."""
        if self.weight_major:
            return weight_major_linear
        return UpcastLinear() if self.upcast else F.linear

    def _forward(self, token_ids: Sequence[int], positions: torch.Tensor, ancestors: torch.Tensor | None,
                 prefill: bool = False, taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the layers on new tokens at `positions` [n], appended to the cache; final hidden states [n, D] and
        the inputs of layers `taps` concatenated [n, len(taps) * D] (None without taps).

        `ancestors` [n, n] is the block's tree (row i sees i and its ancestors); None for a causal chain.
        `prefill`: only the last row is read, so the block runs the fastest products and one attention call
        (plain and speculative decoding prefill the same way, so their caches stay identical).
        """
        n = len(token_ids)
        start, end = self._len, self._len + n
        if end > self._keys[0].shape[1]:
            self._allocate(min(max(2 * end, 256), self.max_positions))
        attend = _BlockAttention(start, ancestors, self.device) if prefill else self._attention(start, ancestors)
        ops = RowOps(attend, self._fast_products, rms_norm) if prefill else RowOps(attend, self._project, self._norm)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)  # [n]
        hidden = F.embedding(ids, self.model.model.embed_tokens.weight)  # [n, D]
        cos, sin = self._cos[positions], self._sin[positions]  # [n, head_dim]
        tapped = {}
        for index, layer in enumerate(self.layers):
            if index in taps:
                tapped[index] = hidden
            hidden = self._layer(index, layer, hidden, cos, sin, start, end, ops)
        self._block_start, self._len = start, end
        taps_out = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None  # [n, len(taps) * D]
        return ops.norm(hidden, self.model.model.norm.weight, self.eps), taps_out  # [n, D]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits [n, V] ([n, V'] with head rows), fp32 on the CPU, from final hidden states [n, D]."""
        return self._project(hidden, self._head).float().cpu()

    def _layer(self, index, layer, hidden, cos, sin, start, end, ops: "RowOps") -> torch.Tensor:
        weights, project = self._weights[index], ops.project
        n = hidden.shape[0]
        normed = ops.norm(hidden, layer.input_layernorm.weight, self.eps)  # [n, D]
        qkv = project(normed, weights.qkv, weights.qkv_bias)  # [n, (H + 2 Hkv) hd]
        query, key, value = qkv.view(n, -1, self.head_dim).transpose(0, 1).split(self._head_split)  # [heads, n, hd]
        query, key = rope(query, cos, sin), rope(key, cos, sin)
        self._keys[index][:, start:end] = key
        self._values[index][:, start:end] = value
        out = ops.attend(query, self._keys[index], self._values[index], layer.self_attn.scaling)  # [H, n, hd]
        o_proj, down_proj = layer.self_attn.o_proj, layer.mlp.down_proj
        hidden = hidden + project(out.transpose(0, 1).reshape(n, -1), o_proj.weight, o_proj.bias)
        normed = ops.norm(hidden, layer.post_attention_layernorm.weight, self.eps)
        gate, up = project(normed, weights.gate_up).chunk(2, dim=-1)  # [n, I] each
        return hidden + project(F.silu(gate) * up, down_proj.weight, down_proj.bias)

    def row_check(self) -> str:
        """'' when every op a scored block runs is row-invariant on this device (checked op by op on this model's
        sizes, `row_check`), else which op differed where; '' for a draft's inexact products, which claim nothing."""
        if not self.batch_invariant:
            return ""
        found = check_ops(self.block_ops, self.model.config.hidden_size, self.num_heads, self.num_kv_heads,
                          self.head_dim, self.device, self.dtype)
        return "; ".join(f"{f.what} at {f.differing[0]}" for f in found if f.differing)

    def block_ops(self, start: int, ancestors: torch.Tensor | None = None) -> "RowOps":
        """The attention, products and norm a scored block after `start` cached tokens runs (`ancestors` [n, n]: its
        tree; None for a chain): what `draftlab.checks.exactness` checks op by op."""
        return RowOps(self._attention(start, ancestors), self._project, self._norm)

    def _attention(self, start: int, ancestors: torch.Tensor | None) -> Callable:
        """attend(query [H, n, hd], keys, values [Hkv, capacity, hd], scale) -> [H, n, hd] for this block's shape."""
        if self.batch_invariant:
            return _RowAttention(start, _gathered_keys(start, ancestors, self.device))
        return _BlockAttention(start, ancestors, self.device)

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
class RowOps:
    """What a pass runs its rows through: exact (every row as if alone) for scored blocks, fastest for prefills."""

    attend: Callable  # (query [H, n, hd], keys, values [Hkv, capacity, hd], scale) -> [H, n, hd]
    project: Callable  # (x [n, D], weight [out, D], bias [out] | None) -> [n, out]
    norm: Callable  # (x [n, D], weight [D], eps) -> [n, D]


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


def _gathered_keys(start: int, ancestors: torch.Tensor | None, device: torch.device) -> list[torch.Tensor] | None:
    """Per tree row, the cache entries it sees in order: the prefix, then its ancestors and itself. None for a chain."""
    if ancestors is None:
        return None
    prefix = torch.arange(start, device=device)  # [start]
    return [torch.cat([prefix, start + row.nonzero()[:, 0].to(device)]) for row in ancestors]


class _BlockAttention:
    """All rows of a block in one SDPA call, with a causal or tree mask (fast, rounding depends on the block)."""

    def __init__(self, start: int, ancestors: torch.Tensor | None, device: torch.device) -> None:
        self.start, self.device = start, device
        self.mask = None if ancestors is None else tree_mask(start, ancestors, device)  # [n, start + n]

    def __call__(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        rows = query.shape[1]
        end = self.start + rows
        mask = self.mask if self.mask is not None else causal_mask(self.start, rows, self.device)
        return F.scaled_dot_product_attention(
            query.unsqueeze(0),  # [1, H, n, hd]
            keys[:, :end].unsqueeze(0),  # [1, Hkv, end, hd]
            values[:, :end].unsqueeze(0),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )[0]  # [H, n, hd]


class _RowAttention:
    """One query row at a time over exactly the keys that row sees: bitwise what scoring it alone computes."""

    def __init__(self, start: int, gathered: list[torch.Tensor] | None) -> None:
        self.start, self.gathered = start, gathered  # gathered: per tree row its key indices; None for a chain

    def __call__(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        rows = [self._row(query[:, i : i + 1], keys, values, scale, i) for i in range(query.shape[1])]
        return torch.cat(rows, dim=1)  # [H, n, hd]

    def _row(self, query, keys, values, scale, i) -> torch.Tensor:
        if self.gathered is None:  # a chain: row i sees the cache and the block up to itself
            seen = self.start + i + 1
            keys, values = keys[:, :seen], values[:, :seen]  # [Hkv, seen, hd]
        else:
            keys, values = keys[:, self.gathered[i]], values[:, self.gathered[i]]
        return F.scaled_dot_product_attention(
            attention_row(query).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), scale=scale, enable_gqa=True
        )[0]  # [H, 1, hd]

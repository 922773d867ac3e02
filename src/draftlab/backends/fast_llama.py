"""A lean forward pass for Llama-family models (Llama, Qwen2), with a static KV cache.

Why: transformers' eager forward adds per-module overhead (masks, attention dispatch, cache concatenation) to a
memory-bound pass. This backend runs the same weights (read from the loaded HF module, never modified) through plain
tensor code:

- q/k/v and gate/up projections concatenated once (copies), so each layer runs 4 matrix products instead of 7.
- KV cache preallocated per layer as [kv_heads, capacity, head_dim]; rolled back by moving `cache_len` (stale
  entries are never read), as gpt-fast does. RoPE tables from the model's own rotary module.
- Exact by construction (a target's default, every dtype): every row of a scored block is bitwise the row its
  token gets scored alone after the same prefix. Products run on fixed-size row chunks along the route measured
  fastest here (`draftlab.backends.routes`), norms and RoPE per row, attention per row over exactly the keys it sees
  (`attention.py`). On CUDA the scored blocks run as static passes replayed as CUDA graphs (`static_step.py`).
- Prefill at full speed: a prompt runs the fastest products and one attention call (plain and speculative
  decoding prefill alike; its other rows are only cached).
- Drafts (not exact: their rounding never reaches the output) run the fastest products: weight-major blocks in
  fp32 on CPUs (`weight_major_linear`); in emulated bf16/fp16, long blocks and prefills with the weights converted
  to fp32 on the fly (`UpcastLinear`).

It implements the `Backend` protocol; the registry (`draftlab.backends`) picks it for `SUPPORTED_MODEL_TYPES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from draftlab.backends.attention import (BlockAttention, MaskedAttention, RowAttention, gathered_keys, key_order,
                                        visible_bias)
from draftlab.backends.base import ROUNDING, all_rows, greedy_rows, is_prefix
from draftlab.backends.numerics import (
    INVARIANT_ROWS,
    UpcastLinear,
    chunk_linear,
    cut_head,
    invariant_linear,
    invariant_rms_norm,
    rms_norm,
    rope,
    weight_major_linear,
)
from draftlab.backends.routes import Route, default_route, dtype_label, upcast_pays
from draftlab.backends.row_check import check_ops
from draftlab.backends.static_step import CAPACITY_STEP, StaticStep, StepGraphs, StepInputs, default_step
from draftlab.errors import DraftlabError
from draftlab.decoding.step import Block, Scores

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")  # qwen2: Llama with q/k/v biases


class FastLlamaBackend:
    """Batch-1 Llama decoding with a static, rollback-by-length KV cache."""

    provides_hidden = True  # score_block(..., with_hidden=True) also returns the final hidden states
    greedy_chain = greedy_rows  # a draft's greedy tokens, one `score` each

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
        step: StaticStep | str | None = "auto",
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

        `step`: how an exact backend runs its scored blocks (`static_step.py`): a `StaticStep`, None for the eager
        step, 'auto' for the device's default (CUDA: static passes replayed as CUDA graphs).
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
        self.step = (default_step(self.device) if step == "auto" else step) if self.batch_invariant else None
        if self.step and self.step.graphs and self.device.type != "cuda":
            raise DraftlabError(f"CUDA graphs need a CUDA device, not {self.device}; run the static step eagerly there")
        self._graphs = StepGraphs(self._static_pass, self.device) if self.step and self.step.graphs else None
        self.numerics = (f"{self.route.label}{f', {self.step.label}' if self.step else ''}" if self.batch_invariant
                         else f"{self.route.label if self.route is not None else 'draft products'} ({ROUNDING})")
        self._keys: list[torch.Tensor] = []  # per layer [kv_heads, capacity, head_dim]
        self._values: list[torch.Tensor] = []
        self._cos = self._sin = torch.empty(0)  # [capacity, head_dim]
        self._len = 0
        self._block_start = 0  # where the last scored block began
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
        if self.step is not None and not (last_only and n > 1):
            return self._static_scores(Block.chain(list(token_ids)), ()).logits
        positions = torch.arange(start, start + n, device=self.device)  # [n]
        hidden, _ = self._forward(token_ids, positions, None, prefill=last_only and n > 1)  # [n, D]
        return self._logits(hidden[-1:] if last_only else hidden)

    @torch.inference_mode()
    def score_block(self, block: Block, with_hidden: bool = False, last_only: bool = False,
                    taps: tuple[int, ...] = ()) -> Scores:
        """Append a tree-shaped block in one pass; logits [n, V] ([1, V] if last_only), hidden states if asked: the
        final ones [n, D], or the inputs of layers `taps` concatenated [n, len(taps) * D]."""
        start, n = self._len, len(block.tokens)
        if self.step is not None and not (last_only and n > 1 and block.is_chain):
            scores = self._static_scores(block, taps if with_hidden else ())
            return Scores(scores.logits[-1:] if last_only else scores.logits, scores.hidden if with_hidden else None)
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
        attend = BlockAttention(start, ancestors, self.device) if prefill else self._attention(start, ancestors)
        ops = RowOps(attend, self._fast_products, rms_norm) if prefill else RowOps(attend, self._project, self._norm)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)  # [n]
        hidden = F.embedding(ids, self.model.model.embed_tokens.weight)  # [n, D]
        cos, sin = self._cos[positions], self._sin[positions]  # [n, head_dim]
        tapped = {}
        for index, layer in enumerate(self.layers):
            if index in taps:
                tapped[index] = hidden
            hidden = self._layer(index, layer, hidden, cos, sin, slice(start, end), ops)
        self._block_start, self._len = start, end
        taps_out = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None  # [n, len(taps) * D]
        return ops.norm(hidden, self.model.model.norm.weight, self.eps), taps_out  # [n, D]

    def _static_scores(self, block: Block, taps: tuple[int, ...]) -> Scores:
        """A block through the static step: logits [n, V] (fp32, CPU), and the taps' inputs [n, len(taps) * D] or
        the final hidden states [n, D].
        A block of up to R rows (the route's chunk) runs as R, padding rows (the first row's position and mask)
        writing to the cache's last entry, which no row sees: products and norms see R rows, as chunked ops would."""
        start, n = self._len, len(block.tokens)
        layout = None if block.is_chain else block.layout()
        depths, ancestors = (torch.arange(n), None) if layout is None else (layout.depths, layout.ancestors)
        if start + n > self._keys[0].shape[1] - 1:  # the last entry is the padding rows' scratch
            self._allocate(min(max(2 * (start + n + 1), 256), self.max_positions))
        capacity = self._keys[0].shape[1]
        pad = max(self.route.rows - n, 0)
        positions = F.pad(start + depths.to(torch.long), (0, pad), value=start + int(depths[0]))  # [n + pad]
        inputs = StepInputs(F.pad(torch.tensor(list(block.tokens), dtype=torch.long), (0, pad)), positions,
                            F.pad(torch.arange(start, start + n), (0, pad), value=capacity - 1),
                            visible_bias(positions, capacity, self.dtype), n,
                            None if ancestors is None else key_order(start, ancestors, capacity)).to(self.device)
        logits, hidden, tapped = (self._graphs or self._static_pass)(inputs, taps)
        self._block_start, self._len = start, start + n
        return Scores(logits[:n].float().cpu(), tapped[:n] if taps else hidden[:n])

    def _static_pass(self, inputs: StepInputs, taps: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """The layers on static inputs (a CUDA graph's pass): logits [m, V], final hidden states [m, D], the taps'
        inputs [m, len(taps) * D] (empty without); m: the block's rows padded to R, where each product and norm runs
        once on the R rows, bitwise what the chunked ops compute for each row."""
        attend = MaskedAttention(inputs.bias, inputs.order, self.step.attention, rows=inputs.rows)
        one_chunk = inputs.ids.shape[0] == self.route.rows
        ops = RowOps(attend, partial(chunk_linear, weight_major=self.route.kind == "weight-major"), rms_norm
                     ) if one_chunk else RowOps(attend, self._project, self._norm)
        hidden = F.embedding(inputs.ids, self.model.model.embed_tokens.weight)  # [m, D]
        cos, sin = self._cos[inputs.positions], self._sin[inputs.positions]  # [m, head_dim]
        tapped = []
        for index, layer in enumerate(self.layers):
            if index in taps:
                tapped.append(hidden)
            hidden = self._layer(index, layer, hidden, cos, sin, inputs.slots, ops)
        hidden = ops.norm(hidden, self.model.model.norm.weight, self.eps)  # [m, D]
        taps_out = torch.cat(tapped, dim=-1) if taps else hidden.new_empty(0)  # [m, len(taps) * D]
        return ops.project(hidden, self._head, None), hidden, taps_out

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits [n, V] ([n, V'] with head rows), fp32 on the CPU, from final hidden states [n, D]."""
        return self._project(hidden, self._head).float().cpu()

    def _layer(self, index, layer, hidden, cos, sin, slots, ops: "RowOps") -> torch.Tensor:
        """One layer on hidden [n, D]; its keys and values are written to cache entries `slots` (a slice, or [n])."""
        weights, project = self._weights[index], ops.project
        n = hidden.shape[0]
        normed = ops.norm(hidden, layer.input_layernorm.weight, self.eps)  # [n, D]
        qkv = project(normed, weights.qkv, weights.qkv_bias)  # [n, (H + 2 Hkv) hd]
        heads = qkv.view(n, -1, self.head_dim).transpose(0, 1)  # [H + 2 Hkv, n, hd]
        query_key = rope(heads[: self.num_heads + self.num_kv_heads], cos, sin)  # elementwise: one pass for both
        query, key, value = query_key[: self.num_heads], query_key[self.num_heads :], heads[-self.num_kv_heads :]
        self._keys[index][:, slots] = key
        self._values[index][:, slots] = value
        out = ops.attend(query, self._keys[index], self._values[index], layer.self_attn.scaling)  # [H, n, hd]
        o_proj, down_proj = layer.self_attn.o_proj, layer.mlp.down_proj
        hidden = hidden + project(out.transpose(0, 1).reshape(n, -1), o_proj.weight, o_proj.bias)
        normed = ops.norm(hidden, layer.post_attention_layernorm.weight, self.eps)
        gate, up = project(normed, weights.gate_up).chunk(2, dim=-1)  # [n, I] each
        return hidden + project(F.silu(gate) * up, down_proj.weight, down_proj.bias)

    def row_check(self) -> str:
        """'' when every op a block runs is row-invariant here (`row_check`), else which differed where ('' for a draft)."""
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
        if self.step is not None:
            order = None if ancestors is None else key_order(start, ancestors, self._keys[0].shape[1]).to(self.device)
            return MaskedAttention(None, order, self.step.attention, start)
        if self.batch_invariant:
            return RowAttention(start, gathered_keys(start, ancestors, self.device))
        return BlockAttention(start, ancestors, self.device)

    def _allocate(self, capacity: int) -> None:
        """(Re)allocate cache buffers and RoPE tables for `capacity` positions, keeping cached entries (a static
        step's capacity rounded up to a multiple of `CAPACITY_STEP`; its graphs, which wrote the old buffers, go)."""
        if self.step is not None:
            capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
            if self._graphs is not None:
                self._graphs.clear()
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

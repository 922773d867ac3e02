"""Attention of the fast backend's passes: per block shape, how query rows meet the cache.

- `BlockAttention`: all rows of a block in one SDPA call, causal or tree mask (prefills and drafts: fast, its
  rounding depends on the block).
- `RowAttention`: one call per query row over exactly the keys it sees, a view of the cache (the exact route of the
  eager step: bitwise what the row scored alone computes).
- `MaskedAttention`: the static step's (`draftlab.backends.static_step`): every call attends over the whole cache,
  the keys a row does not see masked out, so its shapes never depend on the cache's length and a CUDA graph can
  replay it. `rows`: one call per row (exact by construction: every row runs the same call, alone or in a block).
  `block`: a chain's rows in one call, each kv head's query heads and rows as the query rows of one problem
  (exact where the kernel computes each query row on its own, which `draftlab check exact` checks per device).
  A tree's rows run one by one, each over its own keys gathered in the order plain decoding holds them.

Grouped-query attention runs without copying keys: a kv head's G query heads are G query rows of one problem.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from draftlab.backends.numerics import attention_row, causal_mask, tree_mask

ATTENTION_MODES = ("rows", "block")


class BlockAttention:
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


class RowAttention:
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


def gathered_keys(start: int, ancestors: torch.Tensor | None, device: torch.device) -> list[torch.Tensor] | None:
    """Per tree row, the cache entries it sees in order: the prefix, then its ancestors and itself. None for a chain."""
    if ancestors is None:
        return None
    prefix = torch.arange(start, device=device)  # [start]
    return [torch.cat([prefix, start + row.nonzero()[:, 0].to(device)]) for row in ancestors]


def visible_bias(positions: torch.Tensor, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [n, capacity] in `dtype`, on `positions`' device: row i sees the first positions[i] + 1 entries
    of its keys (the cache, then its chain prefix or tree ancestors in order, and itself): 0 there, -inf after."""
    slots = torch.arange(capacity, device=positions.device)  # [capacity]
    seen = slots[None] <= positions[:, None]  # [n, capacity]
    return torch.zeros(seen.shape, dtype=dtype, device=positions.device).masked_fill_(~seen, float("-inf"))


def key_order(start: int, ancestors: torch.Tensor, capacity: int) -> torch.Tensor:
    """Per tree row, every cache entry [n, capacity] in the order the row reads them: the `start` cached ones, its
    ancestors and itself, then the rest (masked out). Plain decoding of the row's path holds the same keys at the
    same places, so the row's attention adds them up in the same order (a hole in a row's keys moved the later ones
    to other lanes of the kernel's sums, and their rounding with them)."""
    order = torch.empty(ancestors.shape[0], capacity, dtype=torch.long)
    for i, seen in enumerate(gathered_keys(start, ancestors.cpu(), torch.device("cpu"))):
        rest = torch.ones(capacity, dtype=torch.bool)
        rest[seen] = False
        order[i] = torch.cat([seen, rest.nonzero()[:, 0]])
    return order


class MaskedAttention:
    """Every query row over the whole cache [Hkv, capacity, hd], the entries it does not see masked out."""

    def __init__(self, bias: torch.Tensor | None, order: torch.Tensor | None, mode: str, start: int = 0,
                 rows: int | None = None) -> None:
        """`bias` [m, capacity] (`visible_bias`); None: a chain's after `start` cached tokens, built at the call (an
        op check's block, whose size and cache the call decides). `order` [n, capacity]: a tree's rows' keys
        (`key_order`), each row then run on its own keys; None for a chain. `rows`: the block's own rows n, the
        first of the m queries (the rest pad the block to the route's R rows); None: every query."""
        self.bias, self.order, self.mode, self.start, self.rows = bias, order, mode, start, rows

    def __call__(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        heads, m, head_dim = query.shape
        bias = self.bias
        if bias is None:  # an op check's keys: padded to aligned rows (a mask row must start on an aligned address)
            keys, values = _aligned(keys), _aligned(values)
            bias = visible_bias(torch.arange(self.start, self.start + m, device=keys.device), keys.shape[1],
                                keys.dtype)  # [m, capacity]
        attend = _grouped if self.mode == "rows" else _one_call
        if self.mode == "block" and self.order is None:  # the block's own rows in one call; padding rows zero
            n = self.rows or m
            return F.pad(_one_call(query[:, :n], keys, values, bias[:n], scale), (0, 0, 0, m - n))  # [H, m, hd]
        rows = [attend(attention_row(query[:, i : i + 1]),
                       keys if self.order is None else keys[:, self.order[i]],
                       values if self.order is None else values[:, self.order[i]], bias[i : i + 1], scale)
                for i in range(self.rows or m)]  # [H, 1, hd] each
        return F.pad(torch.cat(rows, dim=1), (0, 0, 0, m - len(rows)))  # [H, m, hd]; padding rows zero


def _one_call(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
              ) -> torch.Tensor:
    """Rows [H, m, hd] in one call: each kv head's G query heads and m rows as G m query rows of one problem, each
    with its row's mask (the memory-efficient kernel on CUDA); [H, m, hd]. A tree's row runs it alone (m = 1), as
    plain decoding's token does."""
    heads, m, head_dim = query.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    query = query.contiguous()  # a weight-major route's queries come strided; CUDA's fused kernels need stride 1
    with _one_kernel(query.device):
        out = F.scaled_dot_product_attention(
            query.reshape(1, kv_heads, group * m, head_dim), keys[None], values[None],
            attn_mask=bias.repeat(group, 1)[None, None], scale=scale)  # [1, Hkv, G m, hd]; row (g, i) masked as i
    return out.reshape(heads, m, head_dim)  # row (kv, g m + i) is head kv G + g's row i


def _aligned(cache: torch.Tensor, step: int = 64) -> torch.Tensor:
    """A cache [Hkv, length, hd] zero padded to a multiple of `step` entries (the padding is masked out)."""
    return torch.nn.functional.pad(cache, (0, 0, 0, (-cache.shape[1]) % step))


def _grouped(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
             ) -> torch.Tensor:
    """One row's heads [H, 1, hd] (contiguous) as each kv head's G query rows, over the whole cache; [H, 1, hd]."""
    heads, kv_heads, head_dim = query.shape[0], keys.shape[0], query.shape[-1]
    out = F.scaled_dot_product_attention(
        query.view(1, kv_heads, heads // kv_heads, head_dim), keys[None], values[None],
        attn_mask=bias[None, None], scale=scale)  # [1, Hkv, G, hd]
    return out.reshape(heads, 1, head_dim)


def _one_kernel(device: torch.device):
    """On CUDA, the memory-efficient kernel for a block's rows in one call: a kernel whose blocking does not follow
    the number of query rows (others are chosen by shape); elsewhere, whatever SDPA picks."""
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])

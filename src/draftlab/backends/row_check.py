"""Row invariance of an exact route's ops on its device: each row of a block against the same row alone, bitwise.

The norm, the products, attention (a chain's rows after a cached prefix, the queries laid out as the backend lays
them out) and rope, over blocks of `BLOCK_ROWS` sizes, on random inputs of a model's sizes. `draftlab.checks.exactness`
runs it per model shape (`draftlab check exact`); a backend runs it on its own sizes for a study's record
(`FastLlamaBackend.row_check`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from draftlab.backends.numerics import rope

BLOCK_ROWS = (1, 2, 3, 5, 7, 8, 11, 12, 13, 16)  # block sizes checked (CUDA's reductions broke at 4, 7, 11-16)


@dataclass(frozen=True)
class RowFinding:
    """One op: which rows differed from the same rows alone (none: invariant)."""

    what: str
    rows: int  # rows compared
    differing: tuple[str, ...] = ()  # e.g. 'n=7 row 0'


def check_ops(ops_at: Callable, hidden: int, heads: int, kv_heads: int, head_dim: int, device, dtype,
              seed: int = 0) -> list[RowFinding]:
    """`ops_at(start)`: the ops (attend, project, norm) a block after `start` cached tokens runs."""
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def random(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) * scale).to(device, dtype)

    x, weight = random(16, hidden), random(hidden, scale=0.5) + 1  # [16, D], [D]
    width = (heads + 2 * kv_heads) * head_dim
    projection = random(width, hidden, scale=hidden ** -0.5)  # [out, D]
    ops = ops_at(0)
    return [_rows_alone("norm", lambda rows: ops.norm(rows, weight, 1e-6), x),
            _rows_alone("products", lambda rows: ops.project(rows, projection, None), x),
            _attention(ops_at, random(16, width), random(2, kv_heads, 37 + 16, head_dim), heads, head_dim),
            _rope(random(heads, 16, head_dim), random(16, head_dim), random(16, head_dim))]


def _rows_alone(what: str, op, x: torch.Tensor) -> RowFinding:
    """op(x[:n]) row i against op(x[i:i+1]) for every n of BLOCK_ROWS."""
    alone = [op(x[i : i + 1]) for i in range(x.shape[0])]
    differing, rows = [], 0
    for n in BLOCK_ROWS:
        block = op(x[:n])
        differing += [f"n={n} row {i}" for i in range(n) if not torch.equal(block[i : i + 1], alone[i])]
        rows += n
    return RowFinding(what, rows, tuple(differing))


def _attention(ops_at: Callable, qkv: torch.Tensor, cache: torch.Tensor, heads: int, head_dim: int,
               prefix: int = 37) -> RowFinding:
    """Row i of a chain block of n after `prefix` cached keys against the same query alone after prefix + i keys;
    queries [H, n, hd] viewed from one [n, (H + 2 Hkv) hd] projection, as the backend views them."""

    def queries(rows: torch.Tensor) -> torch.Tensor:
        return rows.view(rows.shape[0], -1, head_dim).transpose(0, 1)[:heads]

    scale = head_dim ** -0.5
    alone = [ops_at(prefix + i).attend(queries(qkv[i : i + 1]), cache[0], cache[1], scale) for i in range(16)]
    differing, rows = [], 0
    for n in BLOCK_ROWS:
        block = ops_at(prefix).attend(queries(qkv[:n]), cache[0], cache[1], scale)  # [H, n, hd]
        differing += [f"n={n} row {i}" for i in range(n) if not torch.equal(block[:, i : i + 1], alone[i])]
        rows += n
    return RowFinding("attention", rows, tuple(differing))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> RowFinding:
    """Rope on [H, n, hd] with tables [n, hd], row by row."""
    alone = [rope(x[:, i : i + 1], cos[i : i + 1], sin[i : i + 1]) for i in range(x.shape[1])]
    block = rope(x, cos, sin)
    differing = tuple(f"row {i}" for i in range(x.shape[1]) if not torch.equal(block[:, i : i + 1], alone[i]))
    return RowFinding("rope", x.shape[1], differing)

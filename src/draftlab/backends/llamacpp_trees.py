"""A token tree's block in llama.cpp's cells: its leaves as sequences sharing its sequence's cells.

As llama.cpp's own speculative examples do: the cache before the block belongs to the tree's sequence and is shared
(`llama_memory_seq_cp`) with one sequence per leaf; a block token belongs to the sequences of the leaves below it,
and llama.cpp's mask lets a token see exactly the cells of its first sequence, i.e. the cache, its ancestors and
itself. Keeping a path gives its cells back to the sequence and drops the leaf sequences.

Where the leaves live: a backend of one sequence holds one unified stream, whose other sequences are the leaves. With
a KV stream per sequence (`draftlab serve`), a stream's cells are its sequence's alone; draftlab's
scripts/llama-cpp/stream-leaves.patch puts sequence s in stream s % streams, so the leaves of sequence s are s +
streams, s + 2 streams, ... (`leaf_ids`): every request's tree, beside the others' chains, in one decode.

The batch order puts first children first (`dfs_order`), so the draft's own top path, the usual accepted one, lies
in the cells right after the cache; another accepted path's cells are scattered and are scored again as a chain
into contiguous cells (`TreeCells.scattered`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftlab.decoding.step import Block
from draftlab.errors import DraftlabError

MAX_LEAVES = 63  # a token tree's leaves a sequence may hold (a unified stream's other sequences)


def leaf_ids(seq: int, streams: int, ids: int) -> list[int]:
    """The sequences a tree of `seq` puts its leaves in: those sharing its stream (s % streams == seq) among the
    `ids` a context takes, at most MAX_LEAVES (a unified stream: streams 1, leaves 1..63)."""
    return list(range(seq + streams, ids, streams))[:MAX_LEAVES]


@dataclass(frozen=True)
class TreeCells:
    """A tree block laid out in llama.cpp's batch: the order its tokens are decoded in, each token's sequences and
    position, and where each block index landed."""

    order: list[int]  # block indices in batch order (depth-first, first children first)
    seqs: list[list[int]]  # [n] the leaf sequences of each batch row
    depths: list[int]  # [n] each batch row's depth below the cache
    rows: list[int]  # [n] the batch row of each block index
    leaf_seqs: list[int]  # every leaf's sequence
    path_seq: dict[int, int]  # a block index -> the sequence of the first leaf below it
    tokens: list[int]  # [n] the block's tokens in block order

    @classmethod
    def of(cls, block: Block, sequences: list[int]) -> "TreeCells":
        """The layout of `block`, its leaves in `sequences` (`leaf_ids`; a one-line error for more leaves)."""
        layout = block.layout()
        order = dfs_order(block.parents, layout.children)
        leaves = [i for i in order if not layout.children[i]]
        if len(leaves) > len(sequences):
            raise DraftlabError(f"a token tree on llama.cpp may have at most {len(sequences)} leaves here, got "
                                f"{len(leaves)}")
        seq_of_leaf = dict(zip(leaves, sequences))
        below = leaves_below(layout.children, order)
        depths = layout.depths.tolist()
        return cls(order, [[seq_of_leaf[leaf] for leaf in below[i]] for i in order], [depths[i] for i in order],
                   inverse(order), list(seq_of_leaf.values()), {i: seq_of_leaf[below[i][0]] for i in order},
                   list(block.tokens))

    def laid_out(self, start: int) -> "Rows":
        """The tree's rows of a decode from position `start`: depth first, each in its leaves' sequences, every
        row's logits wanted."""
        return Rows([self.tokens[i] for i in self.order], [start + d for d in self.depths], self.seqs,
                    [True] * len(self.order), self.rows)

    def scattered(self, indices: list[int]) -> int:
        """How many of a kept path's first tokens lie in the cells right after the cache (the rest must move)."""
        return next((j for j, i in enumerate(indices) if self.rows[i] != j), len(indices))


@dataclass(frozen=True)
class Rows:
    """Rows of one llama_decode: tokens, positions, each row's sequences and whether its logits are wanted;
    `back` [n]: each block index's row (a tree laid out depth first), None in block order (a chain)."""

    tokens: list[int]
    positions: list[int]
    seqs: list[list[int]]
    wanted: list[bool]
    back: list[int] | None = None

    @classmethod
    def chain(cls, seq: int, tokens: list[int], start: int, last_only: bool) -> "Rows":
        """A chain of a sequence from position `start` (only its last row's logits with `last_only`)."""
        n = len(tokens)
        wanted = [not last_only or i == n - 1 for i in range(n)]
        return cls(list(tokens), list(range(start, start + n)), [[seq]] * n, wanted)

    @classmethod
    def joined(cls, parts: list["Rows"]) -> "Rows":
        """Several sequences' rows one after another, in one decode."""
        return cls([t for p in parts for t in p.tokens], [x for p in parts for x in p.positions],
                   [x for p in parts for x in p.seqs], [x for p in parts for x in p.wanted])

    def in_block_order(self, rows: torch.Tensor) -> torch.Tensor:
        """The sequence's rows [n, ...] of the decode in block order."""
        return rows if self.back is None else rows[torch.tensor(self.back)]


def dfs_order(parents: tuple[int, ...], children: tuple[tuple[int, ...], ...]) -> list[int]:
    """Block indices in depth-first order from the root (or roots: a draft scores forests), first children first:
    a topological order in which the first children's path comes right after the cache."""
    order, stack = [], [i for i in reversed(range(len(parents))) if parents[i] < 0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node]))
    return order


def leaves_below(children: tuple[tuple[int, ...], ...], order: list[int]) -> dict[int, list[int]]:
    """Each node's leaves (itself if a leaf), in depth-first order."""
    below: dict[int, list[int]] = {}
    for node in reversed(order):
        below[node] = [leaf for child in children[node] for leaf in below[child]] or [node]
    return below


def inverse(order: list[int]) -> list[int]:
    """Position of each block index in `order`."""
    where = [0] * len(order)
    for row, node in enumerate(order):
        where[node] = row
    return where

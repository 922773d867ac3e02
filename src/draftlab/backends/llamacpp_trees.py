"""A token tree's block in llama.cpp's cells: its leaves as sequences of one unified KV stream.

As llama.cpp's own speculative examples do: the cache before the block belongs to sequence 0 and is shared
(`llama_memory_seq_cp`) with one sequence per leaf; a block token belongs to the sequences of the leaves below it,
and llama.cpp's mask lets a token see exactly the cells of its first sequence, i.e. the cache, its ancestors and
itself. Keeping a path gives its cells back to sequence 0 and drops the leaf sequences.

The batch order puts first children first (`dfs_order`), so the draft's own top path, the usual accepted one, lies
in the cells right after the cache; another accepted path's cells are scattered and are scored again as a chain
into contiguous cells (`TreeCells.scattered`). Only one sequence's stream holds trees: in a cache with a stream per
sequence a token cannot belong to several sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftlab.decoding.step import Block
from draftlab.errors import DraftlabError

MAX_LEAVES = 64  # sequences of a unified stream: sequence 0 and a token tree's leaves


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
    def of(cls, block: Block) -> "TreeCells":
        """The layout of `block` (a one-line error for more leaves than a stream's sequences)."""
        layout = block.layout()
        order = dfs_order(block.parents, layout.children)
        leaves = [i for i in order if not layout.children[i]]
        if len(leaves) >= MAX_LEAVES:
            raise DraftlabError(f"a token tree on llama.cpp may have at most {MAX_LEAVES - 1} leaves, got {len(leaves)}")
        seq_of_leaf = {leaf: s + 1 for s, leaf in enumerate(leaves)}
        below = leaves_below(layout.children, order)
        depths = layout.depths.tolist()
        return cls(order, [[seq_of_leaf[leaf] for leaf in below[i]] for i in order], [depths[i] for i in order],
                   inverse(order), list(seq_of_leaf.values()), {i: seq_of_leaf[below[i][0]] for i in order},
                   list(block.tokens))

    def scattered(self, indices: list[int]) -> int:
        """How many of a kept path's first tokens lie in the cells right after the cache (the rest must move)."""
        return next((j for j, i in enumerate(indices) if self.rows[i] != j), len(indices))


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

"""The speculative step's contract: what a drafter proposes and what the target scores.

A step is tree-shaped; a chain is the tree with one path.

- `Proposal` (drafter -> engine): drafted tokens in topological order, each
  with its parent (another drafted token, or -1 for the last committed token),
  and, when the drafter sampled them, the distribution each was drawn from.
- `Block` (engine -> backend): the tokens the target scores in one pass: the
  last committed token (row 0, the root) followed by the proposal's tokens,
  with their parents. Its positions and attention mask are derived from the
  parents, once per tree shape (`tree_layout`), as EAGLE and gpt-fast do.
- `Scores` (backend -> engine): one row of logits per block token and, for
  drafters that read them, the target's final hidden states.

After verification the engine tells the backend which block rows to keep
(`Backend.keep`): the root and the accepted path, in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from draftlab.errors import DraftlabError

ROOT = -1  # the parent of a first-level draft token: the last committed token


@dataclass(frozen=True)
class Proposal:
    """Drafted tokens, their tree, and, when the drafter sampled them, its distributions."""

    tokens: list[int]  # [n] in topological order (a parent comes before its children)
    parents: tuple[int, ...] | None = None  # [n] index of each token's parent in `tokens`, ROOT for the first level; None: a chain
    draft_probs: torch.Tensor | None = None  # [n, V] row i: the distribution token i was drawn from; None: one-hot

    def __post_init__(self) -> None:
        if self.parents is not None:
            check_parents(self.parents, len(self.tokens))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def tree(self) -> tuple[int, ...]:
        """Every token's parent; a chain's are (ROOT, 0, 1, ...)."""
        return self.parents if self.parents is not None else chain_parents(len(self.tokens))

    @property
    def is_chain(self) -> bool:
        """True when the tokens form one path."""
        return self.parents is None or self.parents == chain_parents(len(self.tokens))

    @property
    def levels(self) -> list[int]:
        """Drafted tokens per level, from the root's children down (a chain's: [1] * n); its length is the depth."""
        if self.parents is None:
            return [1] * len(self.tokens)
        depths = node_depths(self.parents)
        return [depths.count(level) for level in range(1, max(depths, default=0) + 1)]

    def within(self, depth: int) -> "Proposal":
        """The tokens at most `depth` levels deep (a chain's first `depth`): a step then commits at most depth + 1."""
        if self.parents is None:
            return self.first(depth)
        kept = [i for i, level in enumerate(node_depths(self.parents)) if level <= depth]
        if len(kept) == len(self.tokens):
            return self
        index = {old: new for new, old in enumerate(kept)}
        parents = tuple(ROOT if self.parents[i] == ROOT else index[self.parents[i]] for i in kept)
        probs = self.draft_probs[kept] if self.draft_probs is not None else None  # [m, V]
        return Proposal([self.tokens[i] for i in kept], parents, probs)

    def first(self, budget: int) -> "Proposal":
        """The first `budget` tokens: still a tree, since parents come before their children."""
        if budget >= len(self.tokens):
            return self
        probs = self.draft_probs[:budget] if self.draft_probs is not None else None  # [budget, V]
        parents = self.parents[:budget] if self.parents is not None else None
        return Proposal(self.tokens[:budget], parents, probs)


@dataclass(frozen=True)
class Block:
    """Tokens the target scores in one pass: the root (last committed token) and the drafted tree."""

    tokens: list[int]  # [n]: root, then the proposal's tokens
    parents: tuple[int, ...]  # [n] index of each token's parent in the block; -1 for the root

    @classmethod
    def of(cls, last_token: int, proposal: Proposal) -> "Block":
        """The block that verifies `proposal` after `last_token`; a proposal past MAX_DRAFT_TOKENS is refused before
        any backend builds its mask, logits or batch for it (a tree's size is its widths' product per level)."""
        if len(proposal.tokens) > MAX_DRAFT_TOKENS:
            raise DraftlabError(f"a proposal may hold at most {MAX_DRAFT_TOKENS} drafted tokens (one llama.cpp batch "
                                f"with its root), got {len(proposal.tokens)}: lower --k or the tree's width")
        return cls([last_token, *proposal.tokens], (-1, *(p + 1 for p in proposal.tree)))

    @classmethod
    def chain(cls, tokens: list[int]) -> "Block":
        """A block of consecutive tokens (each the child of the one before)."""
        return cls(list(tokens), chain_parents(len(tokens)))

    @property
    def is_chain(self) -> bool:
        """True when every token follows the one before it."""
        return self.parents == chain_parents(len(self.tokens))

    def layout(self) -> "TreeLayout":
        """Depths, ancestor mask and children of this block's shape (computed once per shape)."""
        return tree_layout(self.parents)


@dataclass(frozen=True)
class Scores:
    """What the target says about a block."""

    logits: torch.Tensor  # [n, V] fp32 on the CPU; row i scores the token after block token i
    hidden: torch.Tensor | None = None  # [n, D] final hidden states (after the final norm), or the inputs of tapped
    # layers [n, len(taps) * D], when asked for


@dataclass(frozen=True)
class TreeLayout:
    """Bookkeeping of one tree shape: computed once, reused by every block of that shape."""

    depths: torch.Tensor  # [n] distance from the root; a token's position is cache_len + depth
    ancestors: torch.Tensor  # [n, n] bool: row i sees column j iff j is i or an ancestor of i
    children: tuple[tuple[int, ...], ...]  # [n] block indices of each token's children, in block order


def node_depths(parents: tuple[int, ...]) -> list[int]:
    """Each drafted token's level (1 for the children of the root) from its parents."""
    return (tree_layout(tuple(parents)).depths + 1).tolist()


MAX_DRAFT_TOKENS = 511  # drafted tokens one step may score: a block of 512 rows (llama.cpp's batch; a torch tree's
# [n, n] mask and [n, V] logits stay within memory too)


def chain_parents(n: int) -> tuple[int, ...]:
    """Parents of a chain of n tokens: (-1, 0, 1, ..., n-2)."""
    return tuple(range(-1, n - 1))


def check_parents(parents: tuple[int, ...], n: int) -> None:
    """Raise unless `parents` describes a tree over n tokens in topological order."""
    if len(parents) != n:
        raise DraftlabError(f"a proposal of {n} tokens needs {n} parents, got {len(parents)}")
    for i, parent in enumerate(parents):
        if not ROOT <= parent < i:
            raise DraftlabError(f"token {i}'s parent must be ROOT or an earlier token, got {parent}")


@lru_cache(maxsize=256)
def tree_layout(parents: tuple[int, ...]) -> TreeLayout:
    """Depths, ancestor mask and children for a block with these parents (-1: the root's)."""
    n = len(parents)
    depths = [0] * n
    ancestors = torch.eye(n, dtype=torch.bool)  # [n, n]
    children: list[list[int]] = [[] for _ in range(n)]
    for i, parent in enumerate(parents):
        if parent >= 0:
            depths[i] = depths[parent] + 1
            ancestors[i] |= ancestors[parent]
            children[parent].append(i)
    return TreeLayout(torch.tensor(depths), ancestors, tuple(tuple(c) for c in children))

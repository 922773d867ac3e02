"""Verification: which path of the drafted tree the target accepts, and the token it adds.

Words (as in vLLM): a drafted token is *accepted*; after the first rejection the
target's *recovered* token is sampled from the residual normalize(max(0,
target_probs - draft_probs)); when a whole path is accepted the target adds a
*bonus* token from its distribution after the path's last token. Either way,
each step commits num_accepted + 1 tokens.

Verification walks the tree from the root (the last committed token, block row
0). Greedy: move to the child equal to the target's argmax, as long as one
exists. Sampling (multi-candidate rejection sampling, as SpecInfer): try the
node's children in order; child j is accepted with probability min(1,
residual(x_j) / draft_probs_j(x_j)); after each rejection the residual becomes
normalize(max(0, residual - draft_probs_j)); when every child is rejected the
recovered token is drawn from the residual. For a chain (one child per node)
this is exactly Leviathan/Chen rejection sampling, and it is lossless for
children drawn independently from the draft distribution and for
deterministic children (n-gram lookups are one-hot drafts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from draftlab.decoding.sampling import SamplingConfig, logits_to_probs, sample
from draftlab.decoding.step import Block, Proposal


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one proposal: the accepted path and the token the target adds."""

    path: tuple[int, ...]  # proposal indices of the accepted tokens, root to leaf
    next_token: int  # the recovered token (after a rejection) or the bonus token

    @property
    def num_accepted(self) -> int:
        """Accepted draft tokens."""
        return len(self.path)

    def committed(self, proposal: Proposal) -> list[int]:
        """The tokens this step adds to the sequence."""
        return [proposal.tokens[i] for i in self.path] + [self.next_token]

    def kept_rows(self) -> list[int]:
        """Block rows that stay cached: the root and the accepted path."""
        return [0, *(i + 1 for i in self.path)]


def verify_greedy(block: Block, target_logits: torch.Tensor) -> Verdict:
    """Follow the target's argmax through the tree; target_logits [n, V] score the block's rows."""
    target_tokens = target_logits.argmax(dim=-1).tolist()  # [n]
    children = block.layout().children
    node, path = 0, []
    while True:
        match = next((c for c in children[node] if block.tokens[c] == target_tokens[node]), None)
        if match is None:
            return Verdict(tuple(path), target_tokens[node])
        path.append(match - 1)
        node = match


def verify_sampling(
    block: Block,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Multi-candidate rejection sampling over the tree.

    draft_probs [n-1, V]: row i is the distribution proposal token i was drawn from (None: one-hot);
    target_probs [n, V]: the target's distribution after each block row.
    """
    n = len(block.tokens)
    children = block.layout().children
    uniforms = torch.rand(n - 1, generator=generator, dtype=target_probs.dtype)  # [n-1], one per drafted token
    node, path = 0, []
    while True:
        residual = target_probs[node]  # [V]
        accepted = None
        for child in children[node]:
            token, row = block.tokens[child], child - 1
            draft_row = _draft_row(draft_probs, row, token, residual)  # [V]
            # Accept with probability min(1, residual / draft); written without division.
            if uniforms[row] * draft_row[token] < residual[token]:
                accepted = child
                break
            residual = residual_distribution(draft_row, residual)
        if accepted is None:
            return Verdict(tuple(path), sample(residual, generator))
        path.append(accepted - 1)
        node = accepted


def _draft_row(draft_probs: torch.Tensor | None, row: int, token: int, like: torch.Tensor) -> torch.Tensor:
    """The draft distribution [V] of proposal token `row`; one-hot on `token` without probabilities."""
    if draft_probs is not None:
        return draft_probs[row]
    return torch.zeros_like(like).index_fill_(0, torch.tensor([token]), 1.0)


def residual_distribution(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, target_probs - draft_probs)) over [V]; the target itself if that is all zero."""
    residual = torch.clamp(target_probs - draft_probs, min=0.0)  # [V]
    total = residual.sum()
    if total <= 0:
        # Only reachable through rounding, when draft == target: a rejection then
        # has probability zero, and the target is the right fallback.
        return target_probs
    return residual / total


def verify(
    block: Block,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    config: SamplingConfig,
    generator: torch.Generator | None,
) -> Verdict:
    """Verify a block (root + proposal) against target logits [n, V] under `config`."""
    if config.greedy:
        return verify_greedy(block, target_logits)
    target_probs = logits_to_probs(target_logits, config)  # [n, V]
    return verify_sampling(block, draft_probs, target_probs, generator)


Verifier = Callable[[Block, "torch.Tensor | None", torch.Tensor, SamplingConfig, "torch.Generator | None"], Verdict]

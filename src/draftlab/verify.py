"""Verification: which drafted tokens the target accepts, and the token it adds.

Words (as in vLLM): a drafted token is *accepted*; after the first rejection the
target's *recovered* token is sampled from the residual normalize(max(0,
target_probs - draft_probs)); when all drafted tokens are accepted the target
adds a *bonus* token from its distribution after the last one. Either way, each
step commits num_accepted + 1 tokens.

Greedy verification keeps the longest prefix of drafts that equals the
target's argmax; sampling verification is Leviathan/Chen rejection sampling,
which leaves the output distributed exactly as the target's. A drafter that
gives no probabilities (n-gram lookup) is treated as a one-hot draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftlab.sampling import SamplingConfig, logits_to_probs, sample


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one proposal."""

    num_accepted: int
    next_token: int  # the recovered token (after a rejection) or the bonus token

    def committed(self, draft_tokens: list[int]) -> list[int]:
        """The tokens this step adds to the sequence."""
        return draft_tokens[: self.num_accepted] + [self.next_token]


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Longest prefix of drafts [k] equal to the target's argmax over logits [k+1, V]."""
    target_tokens = target_logits.argmax(dim=-1)  # [k+1]
    k = draft_tokens.shape[0]
    matches = (draft_tokens == target_tokens[:k]).to(torch.int64)  # [k]
    num_accepted = int(torch.cumprod(matches, dim=0).sum().item())
    return Verdict(num_accepted, int(target_tokens[num_accepted].item()))


def verify_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Rejection sampling of drafts [k] with draft_probs [k, V] (None: one-hot) against target_probs [k+1, V]."""
    k = draft_tokens.shape[0]
    rows = torch.arange(k)
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_tokens, target_probs.shape[-1]).to(target_probs.dtype)  # [k, V]
    target_at_draft = target_probs[rows, draft_tokens]  # [k]
    draft_at_draft = draft_probs[rows, draft_tokens]  # [k]
    uniforms = torch.rand(k, generator=generator, dtype=target_probs.dtype)  # [k]
    # Accept with probability min(1, target/draft); written without division.
    accepted = (uniforms * draft_at_draft < target_at_draft).to(torch.int64)  # [k]
    num_accepted = int(torch.cumprod(accepted, dim=0).sum().item())
    if num_accepted == k:
        return Verdict(k, sample(target_probs[k], generator))
    residual = residual_distribution(draft_probs[num_accepted], target_probs[num_accepted])
    return Verdict(num_accepted, sample(residual, generator))


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
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    config: SamplingConfig,
    generator: torch.Generator | None,
) -> Verdict:
    """Verify a proposal against target logits [k+1, V] under `config`."""
    tokens = torch.tensor(draft_tokens, dtype=torch.long, device=target_logits.device)  # [k]
    if config.greedy:
        return verify_greedy(tokens, target_logits)
    target_probs = logits_to_probs(target_logits, config)  # [k+1, V]
    return verify_sampling(tokens, draft_probs, target_probs, generator)

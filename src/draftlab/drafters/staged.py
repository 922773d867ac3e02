"""Staged drafting: a model draft whose own drafting is speculated by a cheaper drafter.

The draft model proposes K tokens for the target, but instead of K one-token
passes it lets a helper (n-gram lookup, or a smaller layer draft) guess its
continuation, scores the guesses in one pass of its own, and keeps them the
lossless way, one level down:

- greedy: a guess is kept while it equals the draft's own argmax, so the K
  tokens are exactly what the draft alone would have drafted;
- sampling: a guess g is kept with probability draft_probs[g]; otherwise a
  token is drawn from draft_probs with g removed (renormalised). Each token is
  then distributed exactly as draft_probs, and its row of the proposal is the
  draft's full distribution, so the target's verification stays exact too.

When the helper has nothing to guess, the draft takes one plain step.
"""

from __future__ import annotations

from typing import Sequence

import torch

from draftlab.backends.numerics import scatter_vocab
from draftlab.drafters.base import BlindDrafter, Drafter
from draftlab.drafters.standalone import ModelDrafter
from draftlab.decoding.sampling import SamplingConfig, logits_to_probs, sample
from draftlab.decoding.step import Proposal


class StagedDrafter(BlindDrafter):
    """A `ModelDrafter` whose drafting is itself speculated by `helper` (see the module docstring)."""

    def __init__(self, draft: ModelDrafter, helper: Drafter, model_helper: ModelDrafter | None = None,
                 name: str | None = None) -> None:
        """model_helper: the helper itself when it is a model draft (its cache must not take guesses as settled);
        None for a look-up helper."""
        self.draft = draft
        self.helper = helper
        self.model_helper = model_helper
        self.name = name or f"staged:{helper.name}/{draft.name}"
        self.guessed = 0  # helper tokens offered to the draft, over this drafter's life
        self.kept = 0  # of those, kept by the draft

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Reset both stages."""
        self.draft.begin(prompt_ids)
        self.helper.begin(prompt_ids)

    def propose(self, context, k, sampling, generator) -> Proposal:
        """k tokens of the draft model, drafted in passes over the helper's guesses."""
        logits = self.draft.root_logits(context)  # [V'] after the context; the cache holds it
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        unfed: list[int] = []  # chosen tokens not yet in the draft's cache
        while len(tokens) < k:
            guesses = self._guess(list(context) + tokens, len(context), k - len(tokens), generator)
            rows = self.draft.feed(unfed + guesses)  # logits [len(unfed + guesses), V']
            if unfed:
                logits = rows[len(unfed) - 1]
            fed = len(context) + len(tokens)  # cache length once `unfed` is in
            unfed = []
            for i, guess in enumerate([*guesses, None]):
                token, token_probs = self._pick(logits, guess, sampling, generator)
                tokens.append(token)
                if token_probs is not None:
                    probs.append(token_probs)
                if guess is None or token != guess:
                    self.draft.truncate(fed + i)  # drop the guesses from this one on
                    unfed = [token]
                    break
                self.kept += 1
                logits = rows[len(rows) - len(guesses) + i]  # [V'] after this guess
                if len(tokens) == k:
                    break
        # The cache keeps the kept guesses: the next step's catch-up rolls back only what the target rejected.
        return Proposal(tokens, None, torch.stack(probs) if probs else None)  # draft_probs [k, V]

    def _guess(self, context: list[int], committed: int, n: int, generator) -> list[int]:
        """The helper's guesses for the draft's next tokens (greedy: a guess needs no distribution).

        `context` holds `committed` committed tokens and then tokens drafted in this step, which a model
        helper must not take as settled.
        """
        guesses = self.helper.propose(context, n, SamplingConfig(temperature=0.0), generator).tokens[:n]
        if self.model_helper is not None:
            self.model_helper.unsettle(committed)
        self.guessed += len(guesses)
        return list(guesses)

    def _pick(self, logits: torch.Tensor, guess: int | None, sampling: SamplingConfig,
              generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
        """The draft's next token, given its logits [V'] and the helper's guess (target ids)."""
        if sampling.greedy:
            token, _ = self.draft.pick(logits, sampling, generator)
            return token, None
        draft_probs = logits_to_probs(logits.unsqueeze(0), sampling)[0]  # [V']
        if self.draft.vocab_map is not None:
            draft_probs = scatter_vocab(draft_probs, self.draft.vocab_map, self.draft.target_vocab_size)  # [V]
        if guess is not None:
            if torch.rand((), generator=generator) < draft_probs[guess]:
                return guess, draft_probs
            residual = draft_probs.clone()  # [V]
            residual[guess] = 0.0
            return sample(residual / residual.sum(), generator), draft_probs
        return sample(draft_probs, generator), draft_probs

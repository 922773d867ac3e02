"""The one protocol every draft source implements, and the drafter that proposes nothing.

A `Drafter` proposes tokens that continue the committed context, as a chain or
a tree (`draftlab.step.Proposal`). It does not choose how many (a
`DraftLengthPolicy` does) and does not verify (the verifier does). Drafters
that sample return the probabilities they sampled from, so that rejection
sampling stays exact; drafters that look tokens up return None and are
verified as one-hot drafts.

Every drafter also says whether it reads the target's hidden states
(`reads_target_hidden`) and has `observe`, which the engine calls with the
target's final hidden states of each newly committed and cached token (a no-op
for drafters that do not read them), and `finish`, called with the whole
sequence when a generation ends (drafters that learn across requests keep the
response there).

Draft sources, one file each: `ngram.py` (prompt lookup), `model.py` (a
separate causal LM), `layers.py` (a self-draft of the target's layers),
`pruned.py` (designed layer drafts and their file format), `feature.py`
(EAGLE-style feature drafts and their file format), `heads.py` (Medusa-style
decoder heads and their file format), `suffix.py` (suffix decoding over trees of
this and earlier requests), `shipped.py` (the draft shipped for a target); wrappers: `tree.py` (token
trees grown by a drafter with logits), `staged.py` (a model draft whose own
drafting a cheaper drafter speculates), `adapt.py` (a feature draft or heads that keep learning while they
decode), `cut.py` (a stand-alone draft whose LM head keeps only frequent tokens); `files.py` reads what draft directories share.
`draftlab.registry` builds them from spec strings.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from draftlab.sampling import SamplingConfig
from draftlab.step import Proposal


class Drafter(Protocol):
    """Anything that proposes draft tokens for the engine."""

    name: str
    reads_target_hidden: bool  # True: the engine must pass the target's hidden states to observe

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Forget the previous sequence; a new generation starts from `prompt_ids`."""
        ...

    def propose(
        self, context: Sequence[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Proposal:
        """Up to k tokens that continue `context` (every committed token)."""
        ...

    def observe(self, target_hidden: torch.Tensor) -> None:
        """The target's hidden states [n, D] of the next n committed and cached tokens, in order."""
        ...

    def finish(self, context: Sequence[int]) -> None:
        """The generation ended with `context` (prompt and every committed token): drafters that learn across
        requests (`suffix.py`) keep its response; the others forget nothing they need."""
        ...


class PerRequest:
    """Base for drafters that keep nothing across requests: `finish` does nothing."""

    def finish(self, context: Sequence[int]) -> None:
        """Nothing to keep across requests."""


class BlindDrafter(PerRequest):
    """Base for drafters that do not read the target's hidden states: `observe` does nothing."""

    reads_target_hidden = False

    def observe(self, target_hidden: torch.Tensor) -> None:
        """Ignored: this drafter does not read the target's hidden states."""


class NoDrafter(BlindDrafter):
    """Proposes nothing: the engine then decodes autoregressively."""

    name = "none"

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Nothing to reset."""

    def propose(self, context, k, sampling, generator) -> Proposal:
        """An empty proposal."""
        return Proposal([])


def without_memory(drafter: Drafter) -> Drafter:
    """The drafter as it is, or, for one that learns across requests (suffix decoding, online adaptation), a view
    that learns nothing: for warm-up runs, which must not teach it the answers about to be timed."""
    forget = getattr(drafter, "without_memory", None)
    return forget() if forget is not None else drafter


def draft_chain(
    logits: torch.Tensor,
    k: int,
    pick: Callable[[torch.Tensor], tuple[int, torch.Tensor | None]],
    advance: Callable[[int], torch.Tensor],
) -> Proposal:
    """Draft k tokens one at a time: `pick` a token (and its probabilities [V]) from logits, `advance` past it."""
    tokens: list[int] = []
    probs: list[torch.Tensor] = []
    for i in range(k):
        token, token_probs = pick(logits)
        tokens.append(token)
        if token_probs is not None:
            probs.append(token_probs)
        if i + 1 < k:
            logits = advance(token)
    return Proposal(tokens, None, torch.stack(probs) if probs else None)  # draft_probs [k, V]

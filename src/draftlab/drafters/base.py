"""The one protocol every draft source implements, and the drafter that proposes nothing.

A `Drafter` proposes tokens that continue the committed context, as a chain or
a tree (`draftlab.decoding.step.Proposal`). It does not choose how many (a
`DraftLengthPolicy` does) and does not verify (the verifier does). Drafters
that sample return the probabilities they sampled from, so that rejection
sampling stays exact; drafters that look tokens up return None and are
verified as one-hot drafts.

Every drafter also says whether it reads the target's hidden states
(`reads_target_hidden`) and has `observe`, which the engine calls with the
target's final hidden states of each newly committed and cached token (a no-op
for drafters that do not read them); `hear`, which the engine calls after each
verification with the proposal and the verifier's `Verdict` (the accepted path
and the token the target added), so that no drafter rebuilds it from the
context; and `finish`, called with the whole sequence when a generation ends.

Drafters that learn across requests (suffix decoding's cache, online
adaptation's weights) carry state between generations; every drafter answers
the same questions about it, so that bench, the sweep, the API and the tuner
never ask which kind it is: `held` (how many earlier requests it holds; None:
it keeps nothing), `forgetful` (a view that learns nothing: warm-up runs),
`fork` (an independent drafter starting from what it was built with: a sweep
cell's own), `state`/`load_state` (what it learned, as tensors and lists
`draftlab.files.safeio` saves; None: nothing). `PerRequest` gives the answers of a
drafter that keeps nothing.

Draft sources, one file each: `ngram.py` (prompt lookup), `model.py` (a
separate causal LM), `layers.py` (a self-draft of the target's layers),
`designed.py` (designed layer drafts and their file format), `feature.py`
(EAGLE-style feature drafts and their file format), `heads.py` (Medusa-style
decoder heads and their file format), `suffix.py` (suffix decoding over trees of
this and earlier requests), `shipped.py` (the draft shipped for a target); wrappers: `tree.py` (token
trees grown by a drafter with logits), `staged.py` (a model draft whose own
drafting a cheaper drafter speculates), `adapt.py` (a feature draft or heads that keep learning while they
decode), `cut.py` (a stand-alone draft whose LM head keeps only frequent tokens); `files.py` reads what draft directories share.
`draftlab.registry` builds them from spec strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from draftlab.errors import DraftlabError
from draftlab.decoding.policy import ConfidenceStop
from draftlab.decoding.sampling import SamplingConfig
from draftlab.decoding.step import Proposal
from draftlab.decoding.verify import Verdict


@dataclass(frozen=True)
class DraftAsk:
    """One run's part of a step's drafting: its drafter (the engine's, or one `beside` it), its sequence in the
    target's batch, every committed token, the depth to draft to (0: none), how it samples."""

    drafter: "Drafter"
    seq: int
    context: Sequence[int]
    k: int
    sampling: SamplingConfig
    generator: torch.Generator | None


def propose_each(asks: Sequence[DraftAsk]) -> list[Proposal]:
    """Every ask's proposal from its own drafter, one after another (`Drafter.propose_all` of drafters that draft one
    sequence at a time, or look their drafts up)."""
    return [ask.drafter.propose(ask.context, ask.k, ask.sampling, ask.generator) if ask.k > 0 else Proposal([])
            for ask in asks]


class Drafter(Protocol):
    """Anything that proposes draft tokens for the engine."""

    name: str
    reads_target_hidden: bool  # True: the engine must pass the target's hidden states to observe
    target_taps: tuple[int, ...]  # the target layers whose inputs it reads (concatenated); (): the final states

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Forget the previous sequence; a new generation starts from `prompt_ids`."""
        ...

    def propose(
        self, context: Sequence[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Proposal:
        """Up to k tokens that continue `context` (every committed token)."""
        ...

    def propose_all(self, asks: Sequence[DraftAsk]) -> list[Proposal]:
        """A step's drafts for every run (this drafter's own and those `beside` it), in the asks' order: a draft model
        served drafts each position of every run in one decode (`draftlab.drafters.served`); the others
        `propose_each`."""
        ...

    def lag(self, context: Sequence[int]) -> int:
        """Tokens of `context` its state must still take in before it drafts (a draft model's cache behind the
        context: a new prompt, or steps without drafting); 0 for drafters that look their drafts up."""
        ...

    def observe(self, target_hidden: torch.Tensor) -> None:
        """The target's hidden states [n, D] of the next n committed and cached tokens, in order."""
        ...

    def hear(self, proposal: Proposal, verdict: Verdict) -> None:
        """The verifier's verdict on `proposal` (the step's accepted path and the target's next token)."""
        ...

    def finish(self, context: Sequence[int]) -> None:
        """The generation ended with `context` (prompt and every committed token): drafters that learn across
        requests (`suffix.py`) keep its response; the others forget nothing they need."""
        ...

    def confidence_stop(self) -> ConfidenceStop | None:
        """The adaptive confidence stop it grows trees by, which the engine's policy moves
        (`draftlab.decoding.policy.AdaptiveConfidence`); None: none."""
        ...

    def held(self) -> int | None:
        """Earlier requests whose responses or positions it holds now; None: it keeps nothing across requests."""
        ...

    def forgetful(self) -> "Drafter":
        """A view that learns nothing (for warm-up runs, which must not teach it the answers about to be timed)."""
        ...

    def fork(self) -> "Drafter":
        """An independent drafter that starts from what this one was built with (a sweep cell's own)."""
        ...

    def beside(self, seq: int) -> "Drafter":
        """A drafter for one more sequence (`seq` of the target's batch) decoded at the same time (`draftlab serve`'s
        requests in flight), sharing what this one learns across requests; a one-line error for a drafter that
        decodes one sequence at a time."""
        ...

    def state(self) -> dict | None:
        """What it learned across requests (tensors, numbers, lists), for `draftlab.files.safeio.save_tensors`; None:
        nothing."""
        ...

    def load_state(self, state: dict) -> None:
        """Go on from a `state()`."""
        ...

    def learned(self) -> dict | None:
        """What it learned across requests, for people and the saved draft's record; None: it learns nothing."""
        ...

    def save_learned(self, out: str) -> str:
        """Write what it learned as a draft directory (`model:DIR` loads it); its path."""
        ...


class PerRequest:
    """Base for drafters that keep nothing across requests: `hear` and `finish` do nothing, it holds nothing."""

    target_taps: tuple[int, ...] = ()  # hidden states it reads, if any: the target's final ones

    def propose_all(self, asks: Sequence[DraftAsk]) -> list[Proposal]:
        """Each run's draft from its own drafter, in turn."""
        return propose_each(asks)

    def lag(self, context: Sequence[int]) -> int:
        """Nothing to catch up with worth weighing (a model draft says otherwise)."""
        return 0

    def hear(self, proposal: Proposal, verdict: Verdict) -> None:
        """Nothing to learn from the verdict."""

    def finish(self, context: Sequence[int]) -> None:
        """Nothing to keep across requests."""

    def confidence_stop(self) -> ConfidenceStop | None:
        """No adaptive confidence stop."""
        return None

    def held(self) -> int | None:
        """Nothing held across requests."""
        return None

    def forgetful(self) -> "PerRequest":
        """Itself: it learns nothing anyway."""
        return self

    def fork(self) -> "PerRequest":
        """Itself: nothing it keeps could differ between cells."""
        return self

    def beside(self, seq: int) -> "PerRequest":
        """Refused: it holds one sequence's state (hidden states, a tree's) and decodes one at a time."""
        raise DraftlabError(f"drafter {self.name} decodes one sequence at a time; draftlab serve runs plain decoding, "
                            "ngram and suffix drafts, draft models (model:..., layers:...), EAGLE-3 and token trees "
                            "of those, and on torch feature drafts")

    def state(self) -> dict | None:
        """Nothing learned."""
        return None

    def load_state(self, state: dict) -> None:
        """Nothing to restore."""

    def learned(self) -> dict | None:
        """Nothing learned."""
        return None

    def save_learned(self, out: str) -> str:
        """Refused: nothing learned to save."""
        raise DraftlabError(f"drafter {self.name} does not adapt; nothing learned to save (use --adapt)")


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

    def beside(self, seq: int) -> "NoDrafter":
        """Itself: it keeps nothing."""
        return self


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

"""A draft model served: every request in flight drafts in a KV stream of its own, each draft position of all of them
in one decode.

`draftlab serve --drafter model:NAME` (or `layers:LIST`) holds the draft as the target is held, a stream per slot: on
llama.cpp its GGUF once in a `LlamaCppSequences` (a KV stream per slot, one decode for all), on torch a backend per
slot (`BackendSlots`, in turn). Each request's drafter (`beside`) is a `ModelDrafter` on its slot's stream: it catches
up with the committed tokens, rolls back what the target rejected and is emptied when its request retires, alone. A step's drafting (`propose_all`) is done for every run at once: one decode feeds each
run what its stream lacks and gives each run's first draft logits, then each further position is one decode of a row
per run still drafting, so K positions for 4 requests cost K decodes, not 4K. A prompt's catch-up is fed at most what
the first decode has room for beside the others' tokens (a chunk in all; its run drafts nothing until its stream
holds the context), so a long prompt never holds the others, nor costs their step a second decode.

Draft rows need not be exact: only the target's scores decide what is kept (the draft is loaded on llama.cpp's
repacked kernels, as `draftlab generate`'s is), so a request's tokens are those it gets alone whatever the draft's
rows round to.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from draftlab.backends.base import Backend
from draftlab.decoding.step import Proposal
from draftlab.drafters.base import BlindDrafter, DraftAsk
from draftlab.drafters.standalone import ModelDrafter


class Streams(Protocol):
    """A draft model with a cache per slot (`LlamaCppSequences`, `BackendSlots`)."""

    prefill_chunk: int | None  # tokens a stream is fed at a time at most (None: any)

    def view(self, slot: int) -> Backend:
        """The slot's stream as a backend of its own."""
        ...

    def score(self, blocks: dict[int, Sequence[int]], last_only: bool = False) -> dict[int, torch.Tensor]:
        """Each slot's tokens appended to its cache in one call; each slot's logits [n, V'] ([1, V'] if last_only)."""
        ...


class ServedModelDrafter(BlindDrafter):
    """A model draft with a stream per slot: a `ModelDrafter` per slot, drafting together."""

    max_depth = None

    def __init__(self, like: ModelDrafter, streams: Streams) -> None:
        """`like`: the draft as `draftlab generate` builds it (its name, vocabulary map, window); `streams`: the
        draft's model with a cache per slot."""
        self.streams, self.like, self.name = streams, like, like.name
        self._slots: dict[int, ModelDrafter] = {}
        self.beside(0)  # the engine's own lane: sequence 0

    @property
    def _alone(self) -> ModelDrafter:
        return self._slots[0]

    def beside(self, seq: int) -> ModelDrafter:
        """The draft of sequence `seq`, on its stream."""
        self._slots[seq] = self.like.on(self.streams.view(seq))
        return self._slots[seq]

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self._alone.begin(prompt_ids)

    def propose(self, context, k, sampling, generator) -> Proposal:
        """Sequence 0's draft, as a step of one drafts it (a slot's stream is fed through the batch, not as a
        backend's prompt)."""
        return self.propose_all([DraftAsk(self, 0, context, k, sampling, generator)])[0]

    def finish(self, context: Sequence[int]) -> None:
        self._alone.finish(context)

    def lag(self, context: Sequence[int]) -> int:
        return self._alone.lag(context)

    def propose_all(self, asks: Sequence[DraftAsk]) -> list[Proposal]:
        """Every run's draft, each position of all runs in one decode of the draft's streams."""
        drafting = [i for i, ask in enumerate(asks) if ask.k > 0]
        feeds = self._feeds(asks, drafting)
        ready = [i for i in drafting if self._slots[asks[i].seq].fed == len(asks[i].context)]
        if not feeds:
            return [Proposal([]) for _ in asks]
        logits = self._decode({asks[i].seq: feeds[i] for i in drafting})  # {seq: [V']} after each feed
        tokens: dict[int, list[int]] = {i: [] for i in ready}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in ready}
        while ready:
            for i in ready:
                ask = asks[i]
                token, token_probs = self._slots[ask.seq].pick(logits[ask.seq], ask.sampling, ask.generator)
                tokens[i].append(token)
                if token_probs is not None:
                    probs[i].append(token_probs)
            ready = [i for i in ready if len(tokens[i]) < asks[i].k]
            if ready:
                logits = self._decode({asks[i].seq: tokens[i][-1:] for i in ready})
        for i in tokens:
            self._slots[asks[i].seq].settle(asks[i].context, tokens[i])
        return [Proposal(tokens[i], None, torch.stack(probs[i]) if probs[i] else None) if i in tokens  # [k, V]
                else Proposal([]) for i in range(len(asks))]

    def _feeds(self, asks: Sequence[DraftAsk], drafting: list[int]) -> dict[int, list[int]]:
        """What each drafting run's stream takes in the step's first decode: what it lacks, the runs lacking least
        first, a catch-up cut so that every stream's tokens fit one decode (`prefill_chunk`; at least a token each)."""
        left = self.streams.prefill_chunk  # None: any number
        feeds = {}
        for i in sorted(drafting, key=lambda i: self._slots[asks[i].seq].lag(asks[i].context)):
            feeds[i] = self._slots[asks[i].seq].to_feed(asks[i].context, None if left is None else max(1, left))
            left = None if left is None else left - len(feeds[i])
        return feeds

    def _decode(self, feeds: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """One decode of every stream's tokens; the logits [V'] after each stream's last."""
        return {seq: rows[-1] for seq, rows in self.streams.score(feeds, last_only=True).items()}


"""The requests in flight of `draftlab serve` on the torch backend: one backend per slot, taking turns.

torch's kernels keep a row's order of additions across a block's rows only where draftlab's exact routes say so
(`draftlab.backends.routes`), and across the sequences of a padded batch not at all: a batched attention over
several requests would round each request by what else is in flight. So each slot keeps a backend of its own (its
own KV cache, on the same weights) and a step scores every slot's block in turn, each as it is scored alone. A
request's greedy tokens are then those `draftlab generate` gives on that route, whatever else is in flight; the
requests share the device, not a forward pass (llama.cpp's `LlamaCppSequences` shares the pass too). A slot's block may
be a token tree, and the hidden states its drafter reads come with it, as from the backend alone.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from draftlab.backends.base import Backend
from draftlab.decoding.step import Block, Scores
from draftlab.errors import DraftlabError


class BackendSlots:
    """`slots` backends of one target, each a request's own cache; `score` runs every slot's block in turn."""

    def __init__(self, make: Callable[[], Backend], slots: int, n_ctx: int) -> None:
        """`make()`: a new backend on the target's weights; `n_ctx`: the most tokens a slot holds."""
        if slots < 1:
            raise DraftlabError(f"draftlab serve needs at least one slot, got {slots}")
        self.backends = [make() for _ in range(slots)]
        self.n_ctx = n_ctx
        self.decodes = 0  # passes over the weights: a slot's block or prompt each

    def view(self, slot: int) -> Backend:
        """The slot's backend, for its engine."""
        return self.backends[slot]

    def score(self, blocks: dict[int, Sequence[int]], last_only: bool = False) -> dict[int, torch.Tensor]:
        """Each slot's chain appended to its cache, slot by slot; each slot's logits [n, V] ([1, V] if last_only)."""
        out = {}
        for slot, tokens in blocks.items():
            self._check_room(slot, len(tokens))
            self.decodes += 1
            out[slot] = self.backends[slot].score_block(Block.chain(list(tokens)), last_only=last_only).logits  # [n, V]
        return out

    def _check_room(self, slot: int, tokens: int) -> None:
        """A one-line error for a block past the slot's cells."""
        held = self.backends[slot].cache_len
        if held + tokens > self.n_ctx:
            raise DraftlabError(f"slot {slot} holds {self.n_ctx} tokens; {held + tokens} asked for")

    prefill_chunk = None  # a prompt prefills whole, as `draftlab generate` prefills it on the same route
    keeps_prefixes = False  # a prompt prefills whole, into an empty slot

    def score_blocks(self, blocks: dict[int, Block], with_hidden: bool = False, taps: tuple[int, ...] = ()
                     ) -> dict[int, Scores]:
        """Every slot's block (a chain or a token tree), slot by slot, as its backend scores it alone; logits [n, V]
        per slot, and the hidden states a drafter reads with `with_hidden`."""
        for slot, block in blocks.items():
            self._check_room(slot, len(block.tokens))
        self.decodes += len(blocks)
        return {slot: self.backends[slot].score_block(block, with_hidden, taps=taps) for slot, block in blocks.items()}

    def prefill(self, slot: int, tokens: Sequence[int], final: bool, with_hidden: bool = False,
                taps: tuple[int, ...] = ()) -> torch.Tensor | None:
        """A whole prompt into an empty slot; with `with_hidden`, its hidden states for the slot's drafter."""
        if not final or self.backends[slot].cache_len:
            raise DraftlabError("a torch slot prefills a prompt whole, into an empty slot")
        self.decodes += 1
        return self.backends[slot].score_block(Block.chain(list(tokens)), with_hidden, last_only=True,
                                               taps=taps).hidden

    def passes(self, lengths: dict[int, int]) -> list[int]:
        """A pass per slot: the slots take turns."""
        return [n for n in lengths.values() if n]

    def rollback(self, slot: int, length: int) -> None:
        """Keep only the first `length` tokens of a slot."""
        if length == 0:
            self.backends[slot].reset()
        else:
            self.backends[slot].rollback(length)

    def length(self, slot: int) -> int:
        """Tokens cached in a slot."""
        return self.backends[slot].cache_len

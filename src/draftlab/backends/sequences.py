"""The target as a batch of sequences: the one contract the engine's step scores through.

A step scores every run's block in one call (`score_blocks`), each sequence in cells of its own: `OneSequence` is a
backend holding one sequence (`draftlab generate`, a study's cell), `LlamaCppSequences` holds llama.cpp's sequences
in one context (one, or a KV stream per sequence, every block in one decode; `LlamaCppBackend` is its sequence 0
alone), `BackendSlots` a torch backend per sequence (their blocks in turn).
Each sequence's view (`view`) is a `Backend` of its own, through which its run keeps, rolls back and prefills.
`passes` says how the backend splits a step's blocks into passes over the weights, for the cost of a step
(`draftlab.decoding.kchoice`); `prefill_chunk` is how many prompt tokens it prefills at a time at fixed offsets
(None: a prompt whole), so that a long prompt prefills across the steps of the others.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from draftlab.backends.base import Backend
from draftlab.decoding.step import Block, Scores
from draftlab.errors import DraftlabError


class Sequences(Protocol):
    """Several sequences of one target, each bitwise as it decodes alone."""

    n_ctx: int  # tokens a sequence holds
    prefill_chunk: int | None  # prompt tokens a chunk prefills (chunks at multiples of it); None: whole prompts
    keeps_prefixes: bool  # a sequence's cells, once its request ends, are those a prefill of its tokens leaves (every
    # row as alone, prefilled on the same kernels): a later prompt that starts with them reuses them
    decodes: int  # passes over the weights so far (a served draft's are counted in /metrics)

    def view(self, seq: int) -> Backend:
        """The sequence as a backend of its own (prefill, keep, rollback)."""
        ...

    def score_blocks(self, blocks: dict[int, Block], with_hidden: bool = False, taps: tuple[int, ...] = ()
                     ) -> dict[int, Scores]:
        """Every sequence's block appended to its cache, in one call; logits [n, V] per sequence."""
        ...

    def prefill(self, seq: int, tokens: Sequence[int], final: bool, with_hidden: bool = False,
                taps: tuple[int, ...] = ()) -> torch.Tensor | None:
        """The next chunk of a prompt into an empty or prefilling sequence; once `final`, its cache holds the prompt
        as a whole prefill leaves it. With `with_hidden`, the chunk's hidden states [n, D] (with `taps`, those
        layers' inputs [n, len(taps) * D]) for a drafter that reads them; else None."""
        ...

    def passes(self, lengths: dict[int, int]) -> list[int]:
        """Rows of each pass over the weights that blocks of these lengths (by sequence) cost."""
        ...

    def rollback(self, seq: int, length: int) -> None:
        """Keep a sequence's first `length` tokens."""
        ...

    def length(self, seq: int) -> int:
        """Tokens a sequence's cells hold."""
        ...


class OneSequence:
    """A backend holding one sequence, as `Sequences` (sequence 0)."""

    prefill_chunk = None
    keeps_prefixes = False  # one sequence: `engine.PromptCache` keeps its prompt's prefill instead

    def __init__(self, backend: Backend, n_ctx: int = 1 << 30) -> None:
        self.backend, self.n_ctx = backend, n_ctx
        self.decodes = 0

    def view(self, seq: int) -> Backend:
        return self.backend

    def score_blocks(self, blocks: dict[int, Block], with_hidden: bool = False, taps: tuple[int, ...] = ()
                     ) -> dict[int, Scores]:
        (seq, block), = blocks.items()
        self.decodes += 1
        return {seq: self.backend.score_block(block, with_hidden, taps=taps)}

    def prefill(self, seq: int, tokens: Sequence[int], final: bool, with_hidden: bool = False,
                taps: tuple[int, ...] = ()) -> torch.Tensor | None:
        """A whole prompt (one backend prefills whole)."""
        if not final or self.backend.cache_len:
            raise DraftlabError("a single backend prefills a prompt whole")
        self.decodes += 1
        return self.backend.score_block(Block.chain(list(tokens)), with_hidden, last_only=True, taps=taps).hidden

    def passes(self, lengths: dict[int, int]) -> list[int]:
        return [sum(lengths.values())]

    def rollback(self, seq: int, length: int) -> None:
        if length == 0:
            self.backend.reset()
        else:
            self.backend.rollback(length)

    def length(self, seq: int) -> int:
        return self.backend.cache_len

"""The interface between the engine and a model: score a block of tokens, keep what was accepted.

Cache invariant (the engine relies on it): a backend's cache holds exactly the
tokens it was fed and kept, `cache_len` of them. `score(tokens)` appends a run
of consecutive tokens (a prompt, a chain); `score_block(block)` appends a
tree-shaped block (see `draftlab.decoding.step`), each token at position cache_len +
its depth, seeing the cache and its own ancestors. `keep(indices)` then keeps
the cache as it was before the last block plus that block's tokens at
`indices` (the root and the accepted path), in that order; `rollback(n)`
forgets everything after the first n tokens.

Backends live one per file in this package and are built by name through
`draftlab.backends.make_backend`.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence

import torch

from draftlab.decoding.step import Block, Scores


ROUNDING = "not exact: equal to plain decoding up to rounding"  # said of every mode whose block rows may round apart


class Backend(Protocol):
    """A model with a KV cache that can be cut back to any accepted path."""

    vocab_size: int
    provides_hidden: bool  # score_block(..., with_hidden=True) returns hidden states (final, or tapped layers')
    batch_invariant: bool  # each block row is bitwise the row scoring its token alone would give
    numerics: str  # what the products are and why, for the results' record ('fp32 exact-wm/4 (measured: ...)')

    @property
    def cache_len(self) -> int:
        """Number of tokens currently held in the cache."""
        ...

    def reset(self) -> None:
        """Empty the cache."""
        ...

    def score(self, token_ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Append consecutive tokens to the cache; logits [n, V] (or [1, V] if last_only), fp32 on the CPU."""
        ...

    def score_block(self, block: Block, with_hidden: bool = False, last_only: bool = False,
                    taps: tuple[int, ...] = ()) -> Scores:
        """Append a tree-shaped block in one pass; logits [n, V] ([1, V] if last_only), hidden states if asked:
        the final ones [n, D], or with `taps` the inputs of those layers concatenated [n, len(taps) * D].

        A chain scored `last_only` is a prefill: its other rows are only cached, and a backend may compute it with
        faster products whose rows differ from single rows in the last bits (plain and speculative decoding
        prefill alike, so their caches stay identical)."""
        ...

    def keep(self, indices: Sequence[int]) -> None:
        """Keep the cache before the last block plus that block's tokens at `indices` (ascending)."""
        ...

    def row_check(self) -> str:
        """'' when the ops of an exact route are row-invariant on this device (checked on this model's sizes), else
        which op differed where: a study records it with its numerics."""
        ...

    def exact_rows(self, block: Block) -> set[int]:
        """The block rows scored bitwise as plain decoding would score them (every row, for a batch-invariant
        backend that scores trees exactly); greedy decoding re-verifies a path that leaves them."""
        ...

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        ...

    def synchronize(self) -> None:
        """Wait for queued device work, so that wall-clock timings are honest."""
        ...

    def greedy_chain(self, token: int, n: int, row_tokens: torch.Tensor | None = None) -> list[int]:
        """Append `token`, then each greedy pick after it: n tokens fed in all, the n picks returned as output rows
        (a row's token is `row_tokens[row]` [V'] where the logits are a cut vocabulary's). A draft model's K tokens
        a step: `greedy_rows`, or one call into a native loop that decodes the same tokens."""
        ...


def greedy_rows(backend: Backend, token: int, n: int, row_tokens: torch.Tensor | None = None) -> list[int]:
    """`Backend.greedy_chain` one `score` a token: each pick the first of the largest logits (`choose`'s greedy
    pick) after the token before it."""
    rows: list[int] = []
    for _ in range(n):
        row = int(backend.score([token], last_only=True)[-1].argmax())  # logits [V'] after `token`
        rows.append(row)
        token = row if row_tokens is None else int(row_tokens[row])
    return rows


def all_rows(block: Block) -> set[int]:
    """Every row of a block: `exact_rows` of a backend whose rows do not depend on the tree's shape."""
    return set(range(len(block.tokens)))


def is_prefix(indices: Sequence[int]) -> bool:
    """True when `indices` is 0, 1, ..., m-1: keeping them is a plain rollback."""
    return all(i == j for j, i in enumerate(indices))


class Stopwatch:
    """Accumulates seconds per named phase; synchronizes the device at each edge."""

    def __init__(self, sync=lambda: None) -> None:
        self.seconds: dict[str, float] = {}
        self._sync = sync

    def time(self, phase: str):
        """Context manager that adds the elapsed time to `phase`."""
        return _Phase(self, phase)


class _Phase:
    def __init__(self, watch: Stopwatch, phase: str) -> None:
        self.watch, self.phase = watch, phase

    def __enter__(self):
        self.watch._sync()
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.watch._sync()
        elapsed = time.perf_counter() - self.start
        self.watch.seconds[self.phase] = self.watch.seconds.get(self.phase, 0.0) + elapsed

"""N-gram prompt lookup: copy what followed the latest earlier occurrence of the context's last n tokens."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from draftlab.drafters.base import BlindDrafter
from draftlab.errors import DraftlabError
from draftlab.decoding.step import Proposal


class NGramDrafter(BlindDrafter):
    """Prompt lookup: match the last n tokens (n from max_n down to min_n) earlier in the context."""

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise DraftlabError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.name = f"ngram:{min_n}-{max_n}"

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Stateless: the context is searched afresh each step."""

    def beside(self, seq: int) -> "NGramDrafter":
        """Itself: it keeps no state between steps."""
        return self

    def propose(self, context, k, sampling, generator) -> Proposal:
        """The k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        tokens = np.asarray(context, dtype=np.int64)  # [L]
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) <= n:
                continue
            windows = sliding_window_view(tokens[:-1], n)  # [L-n, n]; each has a continuation
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return Proposal(tokens[start : start + k].tolist())
        return Proposal([])



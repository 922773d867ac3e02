"""Prompts cached across requests: an idle slot keeps the cells of its last request's tokens (prompt and answer), and a
new request goes to the free slot whose cells hold the longest prefix of its prompt (the next turn of a chat resends
the earlier turns), which it then does not prefill again; where none holds any, to the slot used least recently, so
the prefixes kept longest are the ones used last (LRU over the slots' streams, whose memory is allocated already).

Matched on token ids, as llama-server's `cache_prompt` matches a slot's cache: a chat's answer re-templated into the
next prompt may tokenize differently from the ids generated, and the match then stops there. Only where the target's
`Sequences.keeps_prefixes` (cells from a step's block equal those a prefill leaves) is anything reused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class SlotPrefixes:
    """The tokens each slot's cells hold, and when each slot was last used."""

    slots: int
    held: list[tuple[int, ...]] = field(init=False)
    used: list[int] = field(init=False)  # a clock tick per admission: the least recently used slot has the lowest
    clock: int = 0

    def __post_init__(self) -> None:
        self.held = [()] * self.slots
        self.used = [0] * self.slots

    def pick(self, prompt: Sequence[int], free: set[int]) -> tuple[int, int]:
        """(slot, tokens of its cells the prompt reuses): the free slot holding the longest prefix of the prompt (at
        most all its tokens but the last, which the first step scores); else the least recently used free slot."""
        best = max(sorted(free), key=lambda slot: (self.common(slot, prompt), -self.used[slot]))
        self.clock += 1
        self.used[best] = self.clock
        return best, self.common(best, prompt)

    def common(self, slot: int, prompt: Sequence[int]) -> int:
        """Tokens of the prompt's start the slot's cells hold (at most all but the prompt's last)."""
        held, n = self.held[slot], 0
        for n, (a, b) in enumerate(zip(held, prompt[:-1]), start=1):
            if a != b:
                return n - 1
        return n

    def hold(self, slot: int, tokens: Sequence[int]) -> None:
        """The slot's cells now hold these tokens (its request retired)."""
        self.held[slot] = tuple(tokens)

    def forget(self, slot: int) -> None:
        """The slot's cells were emptied."""
        self.held[slot] = ()

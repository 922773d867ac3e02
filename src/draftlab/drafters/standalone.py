"""A separate causal LM (same tokenizer as the target) that drafts autoregressively."""

from __future__ import annotations

from typing import Sequence

import torch

from draftlab.backends.base import Backend
from draftlab.backends.numerics import scatter_vocab
from draftlab.drafters.base import BlindDrafter, draft_chain
from draftlab.errors import DraftlabError
from draftlab.models import LoadedModel
from draftlab.decoding.sampling import choose
from draftlab.decoding.step import Block, Proposal


class ModelDrafter(BlindDrafter):
    """A small causal LM that drafts autoregressively, with its own rolled-back cache.

    Cache invariant: `self._fed` lists exactly the tokens in the draft cache.
    Committed tokens never change, so only the part after the previous context
    can disagree with the new one; that part is rolled back and re-fed.
    """

    max_depth = None  # trees of any depth

    def __init__(self, backend: Backend, name: str = "model", vocab_map: torch.Tensor | None = None,
                 target_vocab_size: int | None = None, window: int = 0) -> None:
        """vocab_map [V']: target token id of each draft output row, for drafts with a cut vocabulary. `window`:
        the draft reads only the prompt's last `window` tokens (0: all of it), so its prefill costs that many."""
        if vocab_map is not None and target_vocab_size is None:
            raise DraftlabError("a draft with a vocabulary map needs the target's vocabulary size")
        if window < 0:
            raise DraftlabError(f"a draft's prompt window is >= 1 tokens (0: the whole prompt), got {window}")
        self.backend = backend
        self.name = name
        self.vocab_map = vocab_map
        self.target_vocab_size = target_vocab_size
        self.window = window
        self._skip = 0  # the context's first tokens the draft never reads (the prompt before its window)
        self._fed: list[int] = []  # the draft's cache: the context from `_skip` on
        self._stable = 0  # prefix of _fed known to be committed

    def on(self, backend: Backend) -> "ModelDrafter":
        """The same draft over another backend of the same model (a served slot's stream), with a cache of its own."""
        return ModelDrafter(backend, self.name, self.vocab_map, self.target_vocab_size, self.window)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Drop the cache; the next proposal prefills the prompt (its window)."""
        self.backend.reset()
        self._fed, self._stable = [], 0
        self._skip = max(0, len(prompt_ids) - self.window) if self.window else 0

    def finish(self, context: Sequence[int]) -> None:
        """The generation ended: its cells are emptied (a served slot's draft stream holds nothing between
        requests)."""
        self.backend.reset()
        self._fed, self._stable = [], 0

    def propose(self, context, k, sampling, generator) -> Proposal:
        """Draft k tokens one at a time; probabilities [k, V] when sampling. Greedy: the first from the context's
        logits, the k - 1 after it in one `greedy_chain` (one call into llama.cpp, where it is the draft's engine)."""
        logits = self._catch_up(context)  # [V']
        if sampling.greedy and k > 0:
            proposal = self._greedy(logits, k)
        else:
            proposal = draft_chain(logits, k, lambda row: self._choose(row, sampling, generator), self._advance)
        self._stable = len(context) - self._skip
        return proposal

    def root_logits(self, context: Sequence[int]) -> torch.Tensor:
        """Tree drafting: catch up with `context`; draft logits [V'] after it."""
        logits = self._catch_up(context)  # [V']
        self._stable = len(context) - self._skip
        return logits

    def tree_logits(self, tokens: list[int], parents: tuple[int, ...], rows: list[int]) -> torch.Tensor:
        """Tree drafting: score the tree so far after the context in one pass; logits [len(rows), V'].

        The whole tree is re-scored (a tree mask over the cache) and then rolled
        back, so the draft cache again holds exactly the context.
        """
        base = self.backend.cache_len
        scores = self.backend.score_block(Block(list(tokens), parents))  # logits [n, V']
        self.backend.rollback(base)
        return scores.logits[rows]

    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Append tokens to the draft cache in one pass; the draft's logits [n, V'] after each (staged drafting)."""
        if not tokens:
            return torch.empty(0)
        self._fed.extend(tokens)
        return self.backend.score(tokens)  # [n, V']

    def truncate(self, length: int) -> None:
        """Keep the context's first `length` tokens in the draft cache (staged drafting drops rejected guesses)."""
        self.backend.rollback(length - self._skip)
        del self._fed[length - self._skip:]

    def unsettle(self, length: int) -> None:
        """Tokens after `length` were proposed, not committed: the next catch-up checks them (staged helpers)."""
        self._stable = min(self._stable, length - self._skip)

    def pick(self, logits: torch.Tensor, sampling, generator) -> tuple[int, torch.Tensor | None]:
        """Pick a token from the draft's logits [V'] and express it (and its probabilities [V]) in target ids."""
        return self._choose(logits, sampling, generator)

    def _greedy(self, logits: torch.Tensor, k: int) -> Proposal:
        """k greedy tokens (target ids) after the context's logits [V']: `draft_chain`'s greedy picks and feeds."""
        tokens = [self._token(int(logits.argmax()))]
        tokens += [self._token(row) for row in self.backend.greedy_chain(tokens[0], k - 1, self.vocab_map)]
        self._fed.extend(tokens[:-1])
        return Proposal(tokens, None, None)

    def _token(self, row: int) -> int:
        """The token id of a draft output row."""
        return row if self.vocab_map is None else int(self.vocab_map[row])

    def _advance(self, token: int) -> torch.Tensor:
        """Feed one drafted token; the draft's logits [V] after it."""
        self._fed.append(token)
        return self.backend.score([token], last_only=True)[-1]

    def _choose(self, logits, sampling, generator) -> tuple[int, torch.Tensor | None]:
        """Pick a token from the draft's logits [V'] and express it (and its probabilities) in target ids."""
        token, token_probs = choose(logits, sampling, generator)
        if self.vocab_map is None:
            return token, token_probs
        if token_probs is not None:
            token_probs = scatter_vocab(token_probs, self.vocab_map, self.target_vocab_size)  # [V]
        return int(self.vocab_map[token]), token_probs

    def _catch_up(self, context: Sequence[int]) -> torch.Tensor:
        """Roll back to the longest common prefix with `context` (from its window on), feed the rest; logits [V]
        after it."""
        return self.backend.score(self.to_feed(context), last_only=True)[-1]

    def to_feed(self, context: Sequence[int], most: int | None = None) -> list[int]:
        """Roll the cache back to its longest common prefix with `context` (from its window on): the tokens to feed
        next (at least one, to get logits; at most `most`), counted as fed."""
        if self._skip:  # a window: compare and feed from it on (no copy of the context otherwise, every step)
            context = context[self._skip:]
        common = self._stable
        limit = min(len(self._fed), len(context))
        while common < limit and self._fed[common] == context[common]:
            common += 1
        common = min(common, len(context) - 1)  # always feed at least one token to get logits
        self.backend.rollback(common)
        del self._fed[common:]
        missing = list(context[common:common + most] if most else context[common:])
        self._fed.extend(missing)
        return missing

    def settle(self, context: Sequence[int], drafted: Sequence[int]) -> None:
        """A draft of `context` is made: the context is committed, the drafted tokens but the last fed after it."""
        self._fed.extend(drafted[:-1])
        self._stable = len(context) - self._skip

    def lag(self, context: Sequence[int]) -> int:
        """Tokens of the context (from its window on) after the part its cache is known to hold."""
        return max(0, len(context) - self._skip - self._stable)

    @property
    def fed(self) -> int:
        """Tokens of the context in the draft's cache (from its window on)."""
        return len(self._fed) + self._skip


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise unless draft and target share tokenizer and vocabulary size."""
    if target.vocab_size != draft.vocab_size:
        raise DraftlabError(
            f"draft {draft.name} has {draft.vocab_size} output tokens but target {target.name} has "
            f"{target.vocab_size}; speculative decoding needs the same vocabulary"
        )
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise DraftlabError(
            f"draft {draft.name} and target {target.name} use different tokenizers; choose a draft from the same family"
        )



"""The speculative decoding loop: draft, score, verify, commit, roll back.

The engine composes four parts and nothing else: a `Drafter` (proposes), the
target `Backend` (scores), the verifier (accepts or rejects) and a
`DraftLengthPolicy` (chooses K). With `NoDrafter` the same loop is plain
autoregressive decoding, which is the baseline every speedup is measured
against.

Cache invariant: between steps the target cache holds every committed token
but the last. A step scores a block (`draftlab.decoding.step.Block`): the last
committed token (the root) and the drafted tokens, a chain or a tree, each
row scoring the token after it. After verification the backend keeps the
root and the accepted path (`Backend.keep`), so that the cache again holds
every committed token but the newest. Drafters that read the target's hidden
states get the rows of exactly those cached tokens through `observe`, so they
too know every committed token but the newest.
"""

from __future__ import annotations

import numbers
import operator
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from draftlab.backends.base import Backend, Stopwatch
from draftlab.drafters.base import Drafter, NoDrafter
from draftlab.errors import DraftlabError
from draftlab.decoding.metrics import GenerationStats
from draftlab.decoding.policy import DraftLengthPolicy, FixedK, with_confidence_stop
from draftlab.decoding.sampling import SamplingConfig
from draftlab.decoding.step import Block, Proposal
from draftlab.decoding.verify import Verifier, verify


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate: length, sampling, seed and stop conditions."""

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not _is_integer(self.max_new_tokens) or self.max_new_tokens < 1:  # NaN, 2.5 and True are not counts
            raise DraftlabError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_integer(self.seed):
            raise DraftlabError(f"seed must be an integer, got {self.seed!r}")


def _is_integer(value) -> bool:
    """An integer (Python's or NumPy's), not a bool, a float or NaN."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass
class GenerationResult:
    """New token ids, their text, and the statistics of the run."""

    token_ids: list[int]
    text: str
    stats: GenerationStats


@dataclass
class PromptCache:
    """What a target backend's cache holds of the last prompt prefilled through it, shared by the engines that
    share the backend (one per cell of a study): the prompt's tokens but the last, and the hidden states their
    prefill gave a drafter that reads them. An engine that starts from the same prompt rolls the cache back to it
    instead of prefilling again; the rows kept are the prefill's own, so its output is the output a fresh prefill
    gives, bit for bit. `name`: the engine's, for the records of its prefills. Only engines given the same
    `PromptCache` may use its backend: a direct use of the backend would leave it stale."""

    name: str = "draftlab"
    tokens: tuple[int, ...] = ()
    hidden: torch.Tensor | None = None  # [len(tokens), D'] the prefill's hidden states (their taps), or None
    taps: tuple[int, ...] = ()
    prefills: int = 0  # prefills computed (reuses are not counted)

    def holds(self, tokens: Sequence[int], backend: Backend, hidden: bool, taps: tuple[int, ...]) -> bool:
        """Whether the backend's cache starts with this prefill and holds what the engine needs of it."""
        return (tuple(tokens) == self.tokens and backend.cache_len >= len(self.tokens)
                and (not hidden or not self.tokens or (self.hidden is not None and self.taps == taps)))

    def forget(self) -> None:
        """After any other use of the backend: nothing held."""
        self.tokens, self.hidden, self.taps = (), None, ()


class StopCriteria:
    """EOS, stop strings and the token budget, checked one committed token at a time."""

    def __init__(self, config: GenerationConfig, decode: Callable[[list[int]], str] | None) -> None:
        self.config = config
        self.decode = decode
        # A stop string of c characters is completed within the last c tokens.
        self.window = max((len(s) for s in config.stop_strings), default=0) + 1

    def check(self, new_tokens: list[int]) -> str:
        """Reason to stop after the newest token ('' to go on)."""
        if new_tokens[-1] in self.config.eos_token_ids:
            return "eos"
        if self.config.stop_strings and self.decode is not None:
            tail = self.decode(new_tokens[-self.window :])
            if any(s in tail for s in self.config.stop_strings):
                return "stop_string"
        if len(new_tokens) >= self.config.max_new_tokens:
            return "max_new_tokens"
        return ""


class SpeculativeEngine:
    """Lossless speculative decoding over a target backend."""

    def __init__(
        self,
        target: Backend,
        drafter: Drafter | None = None,
        policy: DraftLengthPolicy | None = None,
        context_length: int = 1 << 30,
        decode: Callable[[list[int]], str] | None = None,
        verifier: Verifier = verify,
        prompt_cache: PromptCache | None = None,
    ) -> None:
        """verifier: the acceptance rule; only `draftlab audit`'s own tests replace it (with a broken one).
        prompt_cache: shared by the engines over this backend that reuse a prompt's prefill (None: every generation
        prefills)."""
        self.target = target
        self.prompt_cache = prompt_cache
        self.verifier = verifier
        self.drafter = drafter or NoDrafter()
        # A drafter's adaptive confidence stop is moved by a policy around the K policy, not by the drafter.
        self.policy = with_confidence_stop(policy or FixedK(1), self.drafter.confidence_stop())
        self.context_length = context_length
        self.decode = decode
        self._prompt_len = 0
        self.reads_hidden = self.drafter.reads_target_hidden
        self.taps = self.drafter.target_taps  # the target layers whose inputs it reads; (): the final hidden states
        if self.reads_hidden and not target.provides_hidden:
            raise DraftlabError(
                f"drafter {self.drafter.name} reads the target's hidden states, which this backend does not "
                "provide; use another backend"
            )

    def generate(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        """Generate from `prompt_ids`; `on_tokens` sees each step's committed tokens."""
        tokens = self._check_prompt(prompt_ids, config)
        self._prompt_len = len(tokens)
        stats = GenerationStats(prompt_tokens=len(tokens), cache_held=self.drafter.held())
        watch = Stopwatch(self.target.synchronize)
        generator = torch.Generator().manual_seed(config.seed)
        stop = StopCriteria(config, self.decode)
        start = time.perf_counter()
        self._prefill(tokens, watch)
        new: list[int] = []
        while not stats.stop_reason:
            committed, levels, num_accepted = self._step(tokens, config, generator, watch)
            kept, stats.stop_reason = self._commit(committed, new, stop)
            # A stop inside the block drops what follows it: count only accepted tokens that were kept.
            stats.record_step(levels, min(num_accepted, len(kept)))
            tokens.extend(kept)
            if on_tokens is not None:
                on_tokens(kept)
        self.drafter.finish(tokens)
        stats.wall_s = time.perf_counter() - start
        stats.new_tokens = len(new)
        stats.prefill_s = watch.seconds.get("prefill", 0.0)
        stats.draft_s = watch.seconds.get("draft", 0.0)
        stats.target_s = watch.seconds.get("target", 0.0)
        text = self.decode(new) if self.decode is not None else ""
        return GenerationResult(new, text, stats)

    def next_token_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """The target's logits [V] for the token after the prompt, computed exactly as a generation's first step
        computes them (same prefill, same block): the reference an audit of sampling compares with."""
        tokens = list(prompt_ids)
        self._prefill(tokens, Stopwatch(self.target.synchronize))
        logits = self.target.score_block(Block.chain(tokens[-1:])).logits  # [1, V]
        self.target.reset()
        if self.prompt_cache is not None:
            self.prompt_cache.forget()
        return logits[0]

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        """Prefill the prompt into the shared prompt cache, so that the next generation from it (by any engine that
        shares the cache) starts from it; the measurement loop times this once per prompt."""
        self._prefill(list(prompt_ids), Stopwatch(self.target.synchronize))

    def _step(self, tokens, config, generator, watch) -> tuple[list[int], list[int], int]:
        """One draft-verify step: the tokens it commits (accepted + recovered/bonus), drafted tokens per level, accepted count."""
        budget = min(self.policy.next_k(), self._room(tokens, config))
        with watch.time("draft"):
            proposal = self.drafter.propose(tokens, budget, config.sampling, generator) if budget > 0 else Proposal([])
        proposal = proposal.within(budget)  # K is the depth: a chain's length, a tree's levels
        block = Block.of(tokens[-1], proposal)
        with watch.time("target"):
            scores = self.target.score_block(block, self.reads_hidden, taps=self.taps)  # logits [n, V], hidden [n, D']
        verdict = self.verifier(block, proposal.draft_probs, scores.logits, config.sampling, generator)
        kept = verdict.kept_rows()
        if config.sampling.greedy and not block.is_chain and not set(kept) <= self.target.exact_rows(block):
            with watch.time("target"):
                block, proposal, scores, verdict = self._reverify(block, kept, config, generator)
            kept = verdict.kept_rows()
        self.target.keep(kept)
        if scores.hidden is not None:  # rows of the tokens now committed and cached
            self.drafter.observe(scores.hidden[kept])
        self.drafter.hear(proposal, verdict)
        levels = proposal.levels
        self.policy.observe(len(levels), verdict.num_accepted)  # K is the depth: a full path is all accepted
        return verdict.committed(proposal), levels, verdict.num_accepted

    def _reverify(self, block: Block, kept: list[int], config, generator):
        """Greedy, a tree path over rows the backend could not score exactly: score that path again as a chain
        (exact rows) and verify it there, so that what is committed is what plain decoding commits."""
        self.target.rollback(self.target.cache_len - len(block.tokens))
        path = Block.chain([block.tokens[i] for i in kept])
        proposal = Proposal(path.tokens[1:])
        scores = self.target.score_block(path, self.reads_hidden, taps=self.taps)  # logits [m, V]
        return path, proposal, scores, self.verifier(path, None, scores.logits, config.sampling, generator)

    def _room(self, tokens, config) -> int:
        """Deepest draft worth proposing: a step commits at most depth + 1 tokens."""
        generated = len(tokens) - self._prompt_len
        return max(0, min(config.max_new_tokens - generated, self.context_length - len(tokens)) - 1)

    def _prefill(self, tokens: list[int], watch: Stopwatch) -> None:
        """Fill the target cache with every prompt token but the last (or roll it back to them, when the prompt
        cache holds them); start drafter and policy."""
        self.drafter.begin(tokens)
        self.policy.begin()
        cache = self.prompt_cache
        if cache is not None and cache.holds(tokens[:-1], self.target, self.reads_hidden, self.taps):
            self.target.rollback(len(cache.tokens))
            if self.reads_hidden and cache.tokens:
                self.drafter.observe(cache.hidden)
            return
        self.target.reset()
        hidden = None
        if len(tokens) > 1:
            with watch.time("prefill"):
                scores = self.target.score_block(Block.chain(tokens[:-1]), self.reads_hidden, last_only=True,
                                                 taps=self.taps)
            hidden = scores.hidden  # [n - 1, D'] or None
            if hidden is not None:
                self.drafter.observe(hidden)
        if cache is not None:
            cache.tokens, cache.hidden, cache.taps = tuple(tokens[:-1]), hidden, self.taps
            cache.prefills += 1

    @staticmethod
    def _commit(committed: list[int], new: list[int], stop: StopCriteria) -> tuple[list[int], str]:
        """Append committed tokens one by one until a stop condition fires."""
        kept: list[int] = []
        for token in committed:
            new.append(token)
            kept.append(token)
            reason = stop.check(new)
            if reason:
                return kept, reason
        return kept, ""

    def _check_prompt(self, prompt_ids: Sequence[int], config: GenerationConfig) -> list[int]:
        try:
            tokens = [operator.index(t) for t in prompt_ids]
        except TypeError:
            raise DraftlabError("prompt token ids must be integers") from None
        if not tokens:
            raise DraftlabError("the prompt is empty; give at least one token of text")
        check_room(len(tokens), config.max_new_tokens, self.context_length)
        outside = [t for t in tokens if not 0 <= t < self.target.vocab_size]
        if outside:
            raise DraftlabError(f"prompt token id {outside[0]} is not in the target's vocabulary "
                                f"(0..{self.target.vocab_size - 1})")
        return tokens


def tokens_result(prompt_ids, tokens: list[int]) -> GenerationResult:
    """A peer library's output as a generation result: its tokens, and only the counts it reports."""
    return GenerationResult(tokens, "", GenerationStats(prompt_tokens=len(prompt_ids), new_tokens=len(tokens)))


def check_room(prompt_tokens: int, max_new_tokens: int, context_length: int) -> None:
    """A one-line error when the prompt and the new tokens do not fit the model's context."""
    if prompt_tokens + max_new_tokens > context_length:
        room = context_length - prompt_tokens
        hint = f"reduce --max-new-tokens to {room}" if room > 0 else "shorten the prompt"
        raise DraftlabError(f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                            f"model's context of {context_length} tokens; {hint}")

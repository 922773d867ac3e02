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
from draftlab.decoding.step import Block, Proposal, Scores
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


@dataclass(frozen=True)
class Plan:
    """One step's draft: the block the target scores (root and proposal) and the proposal itself."""

    block: Block
    proposal: Proposal


@dataclass
class Generation:
    """One generation's state between steps (`SpeculativeEngine.start`): every committed token, the new ones, the
    statistics, the stop criteria and the sampling generator."""

    tokens: list[int]  # the prompt and every committed token
    config: GenerationConfig
    stats: GenerationStats
    watch: Stopwatch
    generator: torch.Generator
    stop: StopCriteria
    on_tokens: Callable[[list[int]], None] | None = None
    new: list[int] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    @property
    def done(self) -> bool:
        """Whether a stop condition fired."""
        return bool(self.stats.stop_reason)


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
        """Generate from `prompt_ids`; `on_tokens` sees each step's committed tokens. The step is `plan` (draft),
        the target's score of the block, `settle` (verify, keep, commit): `draftlab.serving` runs the same three
        for several generations at once, scoring their blocks in one pass."""
        run = self.start(prompt_ids, config, on_tokens)
        while not run.done:
            plan = self.plan(run)
            with run.watch.time("target"):
                scores = self.target.score_block(plan.block, self.reads_hidden, taps=self.taps)  # logits [n, V]
            self.settle(run, plan, scores)
        return self.finish(run)

    def start(self, prompt_ids: Sequence[int], config: GenerationConfig,
              on_tokens: Callable[[list[int]], None] | None = None) -> "Generation":
        """A generation from `prompt_ids`, its prompt prefilled: what `plan` and `settle` advance a step at a time."""
        tokens = self._check_prompt(prompt_ids, config)
        stats = GenerationStats(prompt_tokens=len(tokens), cache_held=self.drafter.held())
        run = Generation(tokens, config, stats, Stopwatch(self.target.synchronize),
                         torch.Generator().manual_seed(config.seed), StopCriteria(config, self.decode), on_tokens)
        self._prefill(tokens, run.watch)
        return run

    def plan(self, run: "Generation") -> "Plan":
        """The step's draft: the block the target scores next (the last committed token and the proposal)."""
        budget = min(self.policy.next_k(), self._room(run))
        drafted_s = run.watch.seconds.get("draft", 0.0)
        with run.watch.time("draft"):
            proposal = (self.drafter.propose(run.tokens, budget, run.config.sampling, run.generator) if budget > 0
                        else Proposal([]))
        if run.stats.steps == 0:  # the step in which a draft model prefills the prompt
            run.stats.first_draft_s = run.watch.seconds["draft"] - drafted_s
        proposal = proposal.within(budget)  # K is the depth: a chain's length, a tree's levels
        return Plan(Block.of(run.tokens[-1], proposal), proposal)

    def settle(self, run: "Generation", plan: "Plan", scores: Scores) -> list[int]:
        """Verify the scored block, keep its accepted rows, commit its tokens up to a stop; the tokens kept."""
        committed, levels, num_accepted = self._verify(plan, scores, run.config, run.generator, run.watch)
        kept, run.stats.stop_reason = self._commit(committed, run.new, run.stop)
        # A stop inside the block drops what follows it: count only accepted tokens that were kept.
        run.stats.record_step(levels, min(num_accepted, len(kept)))
        run.tokens.extend(kept)
        if run.on_tokens is not None:
            run.on_tokens(kept)
        return kept

    def finish(self, run: "Generation") -> GenerationResult:
        """The generation's result; the drafter hears the whole sequence (what it learns across requests)."""
        self.drafter.finish(run.tokens)
        stats = run.stats
        stats.wall_s = time.perf_counter() - run.started
        stats.new_tokens = len(run.new)
        stats.prefill_s = run.watch.seconds.get("prefill", 0.0)
        stats.draft_s = run.watch.seconds.get("draft", 0.0)
        stats.target_s = run.watch.seconds.get("target", 0.0)
        text = self.decode(run.new) if self.decode is not None else ""
        return GenerationResult(run.new, text, stats)

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

    def _verify(self, plan: "Plan", scores: Scores, config, generator, watch) -> tuple[list[int], list[int], int]:
        """Verify a scored block and keep its accepted rows: the tokens it commits (accepted + recovered/bonus),
        drafted tokens per level, accepted count."""
        block, proposal = plan.block, plan.proposal
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

    def _room(self, run: "Generation") -> int:
        """Deepest draft worth proposing: a step commits at most depth + 1 tokens."""
        room = min(run.config.max_new_tokens - len(run.new), self.context_length - len(run.tokens))
        return max(0, room - 1)

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

"""The speculative decoding loop: draft, score, verify, commit, roll back.

The engine composes four parts and nothing else: a `Drafter` (proposes), the
target `Backend` (scores), the verifier (accepts or rejects) and a
`DraftLengthPolicy` (chooses K). With `NoDrafter` the same loop is plain
autoregressive decoding, which is the baseline every speedup is measured
against.

Cache invariant: between steps the target cache holds every committed token
but the last. A step feeds [last committed, d_1 .. d_k] (k+1 tokens) and gets
k+1 rows of logits: row i scores the token after d_i. After verification the
cache is cut back to (committed before the step + accepted), so that it again
holds every committed token but the newest. Drafters that read the target's
hidden states (`reads_target_hidden`) get the rows of exactly those cached
tokens through `observe`, so they too know every committed token but the newest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from draftlab.backend import Backend, Stopwatch
from draftlab.drafters import Drafter, NoDrafter, Proposal
from draftlab.errors import DraftlabError
from draftlab.metrics import GenerationStats
from draftlab.policy import DraftLengthPolicy, FixedK
from draftlab.sampling import SamplingConfig
from draftlab.verify import verify


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate: length, sampling, seed and stop conditions."""

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise DraftlabError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class GenerationResult:
    """New token ids, their text, and the statistics of the run."""

    token_ids: list[int]
    text: str
    stats: GenerationStats


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
    ) -> None:
        self.target = target
        self.drafter = drafter or NoDrafter()
        self.policy = policy or FixedK(1)
        self.context_length = context_length
        self.decode = decode
        self.reads_hidden = getattr(self.drafter, "reads_target_hidden", False)
        if self.reads_hidden and not getattr(target, "provides_hidden", False):
            raise DraftlabError(
                f"drafter {self.drafter.name} reads the target's hidden states, which this backend does not "
                "provide; use the fast backend (Llama-family targets)"
            )

    def generate(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        """Generate from `prompt_ids`; `on_tokens` sees each step's committed tokens."""
        tokens = self._check_prompt(prompt_ids, config)
        stats = GenerationStats(prompt_tokens=len(tokens))
        watch = Stopwatch(self.target.synchronize)
        generator = torch.Generator().manual_seed(config.seed)
        stop = StopCriteria(config, self.decode)
        start = time.perf_counter()
        self._prefill(tokens, watch)
        new: list[int] = []
        while not stats.stop_reason:
            committed = self._step(tokens, config, generator, watch, stats)
            kept, stats.stop_reason = self._commit(committed, new, stop)
            tokens.extend(kept)
            if on_tokens is not None:
                on_tokens(kept)
        stats.wall_s = time.perf_counter() - start
        stats.new_tokens = len(new)
        stats.prefill_s = watch.seconds.get("prefill", 0.0)
        stats.draft_s = watch.seconds.get("draft", 0.0)
        stats.target_s = watch.seconds.get("target", 0.0)
        text = self.decode(new) if self.decode is not None else ""
        return GenerationResult(new, text, stats)

    def _step(self, tokens, config, generator, watch, stats) -> list[int]:
        """One draft-verify step; returns the tokens it commits (accepted + recovered/bonus)."""
        k = min(self.policy.next_k(), self._room(tokens, config, stats))
        with watch.time("draft"):
            proposal = self.drafter.propose(tokens, k, config.sampling, generator) if k > 0 else Proposal([])
        draft_tokens = proposal.tokens[:k]
        draft_probs = proposal.draft_probs[:k] if proposal.draft_probs is not None else None  # [k, V]
        with watch.time("target"):
            target_logits, target_hidden = self._score([tokens[-1], *draft_tokens])  # [k+1, V], [k+1, D]
        verdict = verify(draft_tokens, draft_probs, target_logits, config.sampling, generator)
        self.target.rollback(len(tokens) + verdict.num_accepted)
        if target_hidden is not None:  # rows of the tokens now committed and cached
            self.drafter.observe(target_hidden[: verdict.num_accepted + 1])
        stats.record_step(len(draft_tokens), verdict.num_accepted)
        self.policy.observe(len(draft_tokens), verdict.num_accepted)
        return verdict.committed(draft_tokens)

    def _score(self, block: list[int], last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target logits [n, V] for a block, and its hidden states [n, D] when the drafter reads them."""
        if self.reads_hidden:
            return self.target.score(block, last_only=last_only, with_hidden=True)
        return self.target.score(block, last_only=last_only), None

    def _room(self, tokens, config, stats) -> int:
        """Most draft tokens worth proposing: a step commits at most k+1 tokens."""
        generated = len(tokens) - stats.prompt_tokens
        return max(0, min(config.max_new_tokens - generated, self.context_length - len(tokens)) - 1)

    def _prefill(self, tokens: list[int], watch: Stopwatch) -> None:
        """Fill the target cache with every prompt token but the last; start drafter and policy."""
        self.target.reset()
        self.drafter.begin(tokens)
        self.policy.begin()
        if len(tokens) > 1:
            with watch.time("prefill"):
                _, target_hidden = self._score(tokens[:-1], last_only=True)
            if target_hidden is not None:
                self.drafter.observe(target_hidden)

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
        tokens = list(prompt_ids)
        if not tokens:
            raise DraftlabError("the prompt is empty; give at least one token of text")
        if len(tokens) + config.max_new_tokens > self.context_length:
            room = self.context_length - len(tokens)
            hint = f"reduce --max-new-tokens to {room}" if room > 0 else "shorten the prompt"
            raise DraftlabError(
                f"prompt ({len(tokens)} tokens) + max_new_tokens ({config.max_new_tokens}) exceeds the "
                f"model's context of {self.context_length} tokens; {hint}"
            )
        return tokens

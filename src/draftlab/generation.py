"""One generation's state and settings between the engine's steps: what to generate (`GenerationConfig`), when to
stop (`StopCriteria`), the run itself (`Generation`, on its `Lane`), a step's draft (`Plan`), the shared prompt cache,
and the result."""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from draftlab.backends.base import Backend, Stopwatch
from draftlab.decoding.kchoice import AcceptanceRecord
from draftlab.decoding.metrics import GenerationStats
from draftlab.decoding.policy import DraftLengthPolicy
from draftlab.decoding.sampling import SamplingConfig
from draftlab.decoding.step import Block, Proposal
from draftlab.drafters.base import Drafter
from draftlab.errors import DraftlabError


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate: length, sampling, seed and stop conditions."""

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    max_draft: int | None = None  # the most tokens a step drafts for this run (0: plain decoding; None: as K says)

    def __post_init__(self) -> None:
        if not _is_integer(self.max_new_tokens) or self.max_new_tokens < 1:  # NaN, 2.5 and True are not counts
            raise DraftlabError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.max_draft is not None and (not _is_integer(self.max_draft) or self.max_draft < 0):
            raise DraftlabError(f"max_draft must be an integer >= 0, got {self.max_draft!r}")
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
    asked: int  # the depth drafted to (the proposal may hold fewer levels)
    beyond: int | None = None  # a chain cut short: its drafted token right after the levels kept

    def within(self, depth: int) -> "Plan":
        """The plan with its draft's first `depth` levels (itself where it holds no more)."""
        if depth >= len(self.proposal.levels):
            return self
        proposal = self.proposal.within(depth)
        beyond = self.proposal.tokens[depth] if self.proposal.is_chain else None
        return Plan(Block.of(self.block.tokens[0], proposal), proposal, depth, beyond)


@dataclass(frozen=True)
class Stepped:
    """What one step did, per run in the step's order."""

    drafted: list[int]  # drafted tokens scored
    committed: list[int]  # tokens committed (accepted, then the target's own)
    rows: int  # rows the target scored

@dataclass
class Lane:
    """One sequence's own parts: its view of the target (its cache), its drafter and its K policy; `seq` is its
    sequence in the target's batch (0 for a generation alone)."""

    target: Backend
    drafter: Drafter
    policy: DraftLengthPolicy
    seq: int = 0


@dataclass
class Generation:
    """One generation's state between steps (`SpeculativeEngine.start`): its lane, every committed token, the new
    ones, the statistics, the stop criteria, the sampling generator, its drafts' acceptance per position, and how
    much of its prompt is prefilled."""

    lane: Lane
    tokens: list[int]  # the prompt and every committed token
    config: GenerationConfig
    stats: GenerationStats
    watch: Stopwatch
    generator: torch.Generator
    stop: StopCriteria
    on_tokens: Callable[[list[int]], None] | None = None
    new: list[int] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    record: AcceptanceRecord = field(default_factory=AcceptanceRecord)
    prefilled: int = 0  # prompt tokens cached (all but the last once prefilled)
    prompt_length: int = 0

    @property
    def done(self) -> bool:
        """Whether a stop condition fired."""
        return bool(self.stats.stop_reason)

    @property
    def ready(self) -> bool:
        """Whether its prompt is prefilled (every token but the last cached): it can step."""
        return self.prefilled >= self.prompt_length - 1


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

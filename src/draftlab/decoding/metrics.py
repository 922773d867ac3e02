"""Per-generation statistics, defined once.

- acceptance_rate = accepted / drafted
- accepted_per_step = accepted / steps
- tokens_per_step = new_tokens / steps (the papers' TAR; accepted_per_step + 1
  except where a stop condition truncated the last step)
- per_position_acceptance[i] = P(draft position i accepted | position i drafted)
- the time split: prefill (target prompt), draft, target (verification),
  overhead = wall - prefill - draft - target.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """What one generation did and how long each part took."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_step_list: list[int] = field(default_factory=list)
    drafted_per_step_list: list[int] = field(default_factory=list)
    levels_per_step_list: list[list[int]] = field(default_factory=list)  # drafted tokens per level, each step
    prefill_s: float = 0.0
    draft_s: float = 0.0
    first_draft_s: float = 0.0  # of draft_s, the first step's: a draft model's own prompt prefill is in it
    target_s: float = 0.0
    wall_s: float = 0.0
    stop_reason: str = ""
    cache_held: int | None = None  # earlier responses the drafter's cross-request cache held at the start; None: none
    window_tokens: int | None = None  # under load (`measure.InFlight`): new tokens of all requests in flight together
    latency_s: float | None = None  # under load: mean seconds from sending one of those requests to its answer

    def record_step(self, levels: list[int], num_accepted: int) -> None:
        """Count one draft-verify step: its drafted tokens per level (a chain of d tokens: [1] * d), accepted count."""
        num_drafted = sum(levels)
        self.steps += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.drafted_per_step_list.append(num_drafted)
        self.accepted_per_step_list.append(num_accepted)
        self.levels_per_step_list.append(list(levels))

    @property
    def draft_prefill_s(self) -> float:
        """What the first step's drafting cost beyond a later step's mean: a draft model's prefill of the prompt
        (charged to decoding, as it runs in the first step); 0 with fewer than 2 steps."""
        if self.steps < 2:
            return 0.0
        return max(0.0, self.first_draft_s - (self.draft_s - self.first_draft_s) / (self.steps - 1))

    @property
    def depth_per_step_list(self) -> list[int]:
        """The drafted depth of every step: a chain's length, a tree's number of levels."""
        return [len(levels) for levels in self.levels_per_step_list]

    @property
    def has_trees(self) -> bool:
        """True when some step drafted a tree with more than one token on a level."""
        return any(max(levels, default=1) > 1 for levels in self.levels_per_step_list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted draft tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def accepted_per_step(self) -> float:
        """Accepted draft tokens per step."""
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Committed tokens per target step (TAR)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def overhead_s(self) -> float:
        """Wall time not spent in the target or the drafter."""
        return max(0.0, self.wall_s - self.prefill_s - self.draft_s - self.target_s)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per wall-clock second, prefill included."""
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    def per_position_acceptance(self) -> list[float]:
        """P(position i accepted | drafted) for i = 0 .. max depth - 1 (a tree's positions are its levels)."""
        depths = self.depth_per_step_list
        rates = []
        for i in range(max(depths, default=0)):
            drafted = sum(1 for d in depths if d > i)
            accepted = sum(1 for a in self.accepted_per_step_list if a > i)
            rates.append(accepted / drafted if drafted else 0.0)
        return rates

    def to_dict(self) -> dict:
        """Plain fields plus the derived metrics, for JSON."""
        out = asdict(self)
        out.update(
            acceptance_rate=self.acceptance_rate,
            accepted_per_step=self.accepted_per_step,
            tokens_per_step=self.tokens_per_step,
            overhead_s=self.overhead_s,
            tokens_per_s=self.tokens_per_s,
            per_position_acceptance=self.per_position_acceptance(),
        )
        return out

"""The analytical throughput model: predict tokens/s for any (draft, K) from cheap measurements.

Two formulas, with the inputs they need:

- The simplified model of "Decoding Speculative Decoding":
      Tput(K) = TAR(K) / (t_target(K) + t_draft(K))   (1 / (...) when TAR <= 1)
  where t_target(K) is the mean time to score the step's block (1 + the
  tokens drafted; an n-gram lookup often drafts fewer than K, so the block
  size is a distribution) and t_draft(K) the time to draft them. TAR(K) comes from per-position acceptance
  measured once at K_max: with greedy verification, the accepted count at
  K <= K_max is min(accepted at K_max, K) (the first K drafted tokens do not
  depend on K), so E[accepted(K)] = sum_{j=1..K} P(accepted >= j).
- Leviathan et al.: speedup = (1 - a^(K+1)) / ((1 - a)(cK + 1)), with a the
  per-token acceptance rate (assumed independent across positions) and
  c = t_draft(1 token) / t_target(1 token). It assumes the target's time does
  not grow with K, which the simplified model does not.

Uncertainty: TAR's standard error comes from the number of steps measured
(the variance of min(accepted, K) follows from P(accepted >= j)), or, when
larger, from the spread between prompts (steps of one generation are
correlated, so a few prompts know less than their step count says); block and
drafting times carry the relative spread of their repeated timings plus the
machine's drift measured during calibration. `predict` turns them into an
interval of tokens/s (TAR +- 2 standard errors, times +- their spread).

Token trees: K is the tree's depth, the accepted path plays the part of the
accepted prefix (so TAR(K) comes from P(path >= j) the same way), and the
block holds 1 + the nodes of the first K levels, a distribution measured at
K_max and cut at depth K (`DraftProfile.tree_nodes`); calibration times every
block size those trees produce. A static shape's first K levels do not depend
on K; a dynamic tree with a node budget spends it on fewer levels when K is
smaller, so calibrate it at the depth you will run.

For sampling the same identity holds for a drafter whose first K proposals do
not depend on K (all of draftlab's): the accepted prefix at K_max, cut at K, is
distributed as the accepted prefix at K, since the verifier's decisions at
positions < K never look at later positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens_per_step(accepted_at_least: list[float], k: int) -> float:
    """TAR at K: 1 + sum_{j=1..K} P(accepted >= j), from P(accepted >= j) measured at K_max >= K."""
    if k > len(accepted_at_least):
        raise ValueError(f"acceptance measured up to K={len(accepted_at_least)}, asked for K={k}")
    return 1.0 + sum(accepted_at_least[:k])


def at_least(counts: list[int], k_max: int) -> list[float]:
    """P(count >= j) for j = 1..k_max over all steps (counts of accepted, or of drafted, tokens)."""
    if not counts:
        return [0.0] * k_max
    return [sum(c >= j for c in counts) / len(counts) for j in range(1, k_max + 1)]


def accepted_at_least(accepted_per_step: list[int], drafted_per_step: list[int], k_max: int) -> list[float]:
    """P(accepted >= j), j = 1..k_max, over every step of a run at K_max.

    Steps that drafted fewer than K_max tokens (an n-gram lookup that found no
    match proposes nothing) count too: leaving them out would overstate TAR.
    """
    return at_least(accepted_per_step, k_max)


def prompt_standard_errors(accepted_per_prompt: list[list[int]], k_max: int) -> list[float]:
    """Standard error of TAR at K = 1..k_max with each prompt's steps as one cluster; empty below 2 prompts.

    The cluster-robust standard error of the mean of min(accepted, K) over all steps, with the G / (G - 1)
    small-sample factor for G prompts: it sees what the step count cannot, that acceptance differs between
    prompts more than between steps of one generation.
    """
    clusters = [steps for steps in accepted_per_prompt if steps]
    total = sum(len(steps) for steps in clusters)
    if len(clusters) < 2:
        return []
    errors = []
    for k in range(1, k_max + 1):
        mean = sum(min(a, k) for steps in clusters for a in steps) / total
        squares = sum(sum(min(a, k) - mean for a in steps) ** 2 for steps in clusters)
        errors.append((len(clusters) / (len(clusters) - 1) * squares) ** 0.5 / total)
    return errors


def leviathan_tokens_per_step(acceptance: float, k: int) -> float:
    """Expected tokens per step with i.i.d. acceptance a: (1 - a^(K+1)) / (1 - a)."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def leviathan_speedup(acceptance: float, k: int, cost_ratio: float) -> float:
    """Leviathan et al.'s speedup over autoregressive decoding: (1 - a^(K+1)) / ((1 - a)(cK + 1))."""
    return leviathan_tokens_per_step(acceptance, k) / (cost_ratio * k + 1.0)


def simplified_throughput(tokens_per_step: float, t_target: float, t_draft: float) -> float:
    """Tokens/s = TAR / (t_target + t_draft), or 1 / (...) when TAR <= 1."""
    return max(tokens_per_step, 1.0) / (t_target + t_draft)


@dataclass
class DraftProfile:
    """What the model needs to know about one draft."""

    name: str
    draft_s_per_token: float  # time to draft one token with a model draft (0 for n-gram lookup)
    accepted_at_least: list[float]  # P(accepted >= j), j = 1..K_max
    per_step_draft_s: float = 0.0  # a fixed cost per step (n-gram lookup), on top of per-token time
    drafted_at_least: list[float] = field(default_factory=list)  # P(drafted >= j); empty: always K
    steps: int = 0  # steps the acceptance was measured over (0: unknown, no interval)
    cost_spread: float = 0.0  # relative spread of the drafting time per step across prompts
    tree_nodes: list[list[list[float]]] = field(default_factory=list)  # [K-1]: (nodes, probability) within depth K; empty: a chain
    prompt_tar_se: list[float] = field(default_factory=list)  # [K-1]: TAR's standard error over prompts; empty: < 2 prompts

    def tar_standard_error(self, k: int) -> float:
        """Standard error of TAR at K: sqrt(Var[min(accepted, K)] / steps), or the one over prompts when larger."""
        if self.steps <= 0:
            return 0.0
        at_least = self.accepted_at_least[:k]
        mean = sum(at_least)
        second = sum((2 * j - 1) * p for j, p in enumerate(at_least, start=1))  # E[min(A, K)^2]
        over_steps = max(second - mean * mean, 0.0) ** 0.5 / self.steps**0.5
        over_prompts = self.prompt_tar_se[k - 1] if k <= len(self.prompt_tar_se) else 0.0
        return max(over_steps, over_prompts)

    @property
    def k_max(self) -> int:
        return len(self.accepted_at_least)

    @property
    def acceptance_rate(self) -> float:
        """Per-token acceptance a for Leviathan's formula: accepted / drafted at K_max."""
        expected_accepted = sum(self.accepted_at_least)
        return expected_accepted / self.k_max if self.k_max else 0.0

    def expected_drafted(self, k: int) -> float:
        """Mean tokens drafted per step at K: sum_{j<=K} P(drafted >= j) (K for a model draft, its nodes for a tree)."""
        if self.tree_nodes:
            return sum(n * p for n, p in self.tree_nodes[k - 1])
        return sum(self.drafted_at_least[:k]) if self.drafted_at_least else float(k)

    def drafted_distribution(self, k: int) -> list[tuple[int, float]]:
        """(d, P(d tokens drafted)) at K, from P(drafted >= j) at K_max; a model draft always drafts K.

        A tree drafts the nodes of its first K levels: the distribution measured at K_max, cut at depth K.
        """
        if self.tree_nodes:
            return [(int(n), p) for n, p in self.tree_nodes[k - 1]]
        if not self.drafted_at_least:
            return [(k, 1.0)]
        at_least = [1.0, *self.drafted_at_least[:k]]  # P(drafted >= 0..K)
        return [(d, at_least[d] - (at_least[d + 1] if d < k else 0.0)) for d in range(k + 1)]

    def t_draft(self, k: int) -> float:
        """Seconds spent drafting per step at K."""
        return self.per_step_draft_s + self.expected_drafted(k) * self.draft_s_per_token


@dataclass
class TargetProfile:
    """Target scoring time by block size (1..K_max+1 tokens), at the context length it was measured at."""

    name: str
    score_s: dict[int, float] = field(default_factory=dict)  # block size -> seconds (median of interleaved repeats)
    overhead_s_per_step: float = 0.0  # engine bookkeeping per step
    score_spread: dict[int, float] = field(default_factory=dict)  # block size -> relative half-IQR of its timings
    drift: float = 0.0  # relative change of the machine's speed from the first to the last calibration round
    tree_s: dict[int, float] = field(default_factory=dict)  # block size -> seconds for a tree-shaped block, where timed

    def relative_uncertainty(self, blocks: list[tuple[int, float]]) -> float:
        """Relative half-width of the target's time for blocks of 1 + d tokens, d distributed as given."""
        spread = sum(p * self.score_spread.get(1 + d, 0.0) for d, p in blocks)
        return spread + abs(self.drift)

    def t_target(self, block: float) -> float:
        """Seconds to score a block of `block` tokens: measured, or linear between the nearest measured sizes."""
        if block in self.score_s:
            return self.score_s[block]
        sizes = sorted(self.score_s)
        if len(sizes) == 1:
            return self.score_s[sizes[0]]
        below = [n for n in sizes if n < block][-1:] or sizes[:1]
        above = [n for n in sizes if n > block][:1] or sizes[-1:]
        low, high = (below[0], above[0]) if below[0] != above[0] else (sizes[-2], sizes[-1])  # past the ends: extend
        return self.score_s[low] + (block - low) * (self.score_s[high] - self.score_s[low]) / (high - low)

    def expected_t_target(self, drafted: list[tuple[int, float]]) -> float:
        """Mean seconds per step to score blocks of 1 + d tokens, d distributed as `drafted`.

        Block time is far from linear on some hardware (on a 2-core CPU, 4 tokens cost
        ~1.45x 3 tokens), so the mean of the times is taken, not the time of the mean block.
        """
        return sum(p * self.t_target(1 + d) for d, p in drafted)

    def expected_t_tree(self, drafted: list[tuple[int, float]]) -> float:
        """As `expected_t_target`, for a tree's blocks of 1 + d tokens: the tree's timed cost where the profile has
        it (a tree gathers each row's ancestors, so it costs more than a chain), else a chain's."""
        return sum(p * self.tree_s.get(1 + d, self.t_target(1 + d)) for d, p in drafted)

    @property
    def autoregressive_tokens_per_s(self) -> float:
        return 1.0 / (self.score_s[1] + self.overhead_s_per_step)


@dataclass(frozen=True)
class Prediction:
    """Both formulas' predictions for one (draft, K), with their inputs."""

    draft: str
    k: int
    tokens_per_step: float
    t_target: float
    t_draft: float
    tokens_per_s: float  # simplified model
    speedup: float  # simplified model, over the target's autoregressive throughput
    tokens_per_s_low: float  # the simplified model's interval, from the profile's uncertainty
    tokens_per_s_high: float
    leviathan_acceptance: float
    leviathan_c: float
    leviathan_speedup: float
    leviathan_tokens_per_s: float


def predict(target: TargetProfile, draft: DraftProfile, k: int) -> Prediction:
    """Predict throughput of `draft` at K with both formulas."""
    tar = expected_tokens_per_step(draft.accepted_at_least, k)
    t_target = target.expected_t_target(draft.drafted_distribution(k)) + target.overhead_s_per_step
    t_draft = draft.t_draft(k)
    tokens_per_s = simplified_throughput(tar, t_target, t_draft)
    low, high = _interval(target, draft, k, tar, t_target, t_draft)
    ar = target.autoregressive_tokens_per_s
    acceptance = draft.acceptance_rate
    c = draft.t_draft(1) / (target.score_s[1] + target.overhead_s_per_step)
    lev = leviathan_speedup(acceptance, k, c)
    return Prediction(draft.name, k, tar, t_target, t_draft, tokens_per_s, tokens_per_s / ar, low, high, acceptance, c,
                      lev, lev * ar)


def _interval(target: TargetProfile, draft: DraftProfile, k: int, tar: float, t_target: float,
              t_draft: float) -> tuple[float, float]:
    """Tokens/s interval: TAR +- 2 standard errors over step times +- their relative spread."""
    se = draft.tar_standard_error(k)
    h_target = target.relative_uncertainty(draft.drafted_distribution(k))
    h_draft = draft.cost_spread + abs(target.drift)
    slow = t_target * (1 + h_target) + t_draft * (1 + h_draft)
    fast = max(t_target * (1 - h_target) + t_draft * (1 - h_draft), 1e-9)
    return max(tar - 2 * se, 1.0) / slow, max(tar + 2 * se, 1.0) / fast

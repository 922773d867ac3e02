"""A losslessness audit users can run on their own deployment: is speculative sampling exact here?

For one prompt and sampling settings, the audit draws many seeded
continuations of the first few tokens three ways and compares them position
by position:

- the reference: draftlab's plain autoregressive sampling, which draws every
  token from the target's own (warped) distribution;
- draftlab's speculative engine with each drafter at K;
- Hugging Face assisted generation with the same draft, where HF can run it.

Position 1 is also compared with the target's exact distribution, computed by
the same backend, dtype and numerics as the plain decoding it audits (its first
step, `SpeculativeEngine.next_token_logits`): with top-p, a reference from
other numerics can leave a token out of the nucleus that the audited backend
keeps, and a lossless method would then fail. Each comparison is a chi-square test (categories expected
fewer than 5 times are pooled) with a Bonferroni-corrected level, and the
total-variation distance beside the TVD that sampling noise alone gives (two
halves of the reference). The number of samples is sized to fit a time budget.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from scipy.stats import chi2_contingency, chisquare

from draftlab.engine import SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.decoding.sampling import SamplingConfig, logits_to_probs

END = -1  # the category of a position past an early end of sequence

Sampler = Callable[[int], list[int]]  # seed -> the first tokens of one continuation


@dataclass(frozen=True)
class AuditSettings:
    """How many samples, of how many positions, within how much time, at what level."""

    positions: int = 3
    samples: int = 400  # per method, at most
    budget_s: float = 300.0  # for all sampling together
    alpha: float = 0.01  # family-wise: divided over every test of the audit

    def __post_init__(self) -> None:
        if self.positions < 1 or self.samples < 20 or self.budget_s <= 0 or not 0 < self.alpha < 1:
            raise DraftlabError("audit needs positions >= 1, samples >= 20, budget > 0 and 0 < alpha < 1")


@dataclass(frozen=True)
class PositionCheck:
    """One position of one method against the reference."""

    position: int  # 1-based
    samples: int
    pvalue: float
    tvd: float
    noise_tvd: float  # TVD between the reference's two halves: what sampling noise alone gives
    exact_pvalue: float | None = None  # position 1 only: against the target's exact distribution

    def ok(self, level: float) -> bool:
        """True when no test of this position rejects at `level`."""
        return self.pvalue > level and (self.exact_pvalue is None or self.exact_pvalue > level)


@dataclass
class MethodAudit:
    """A method's checks and its verdict."""

    method: str
    checks: list[PositionCheck] = field(default_factory=list)
    passed: bool = True
    seconds: float = 0.0


@dataclass
class AuditReport:
    """Every method's verdict, the samples drawn and the level used."""

    samples: int
    level: float  # per-test level after the Bonferroni correction
    methods: list[MethodAudit]

    @property
    def passed(self) -> bool:
        """True when every draftlab method passed (HF's verdict is reported, not required)."""
        return all(m.passed for m in self.methods if not m.method.startswith("hf"))

    def to_dict(self) -> dict:
        """Plain data, for JSON."""
        return {"samples": self.samples, "level": self.level, "passed": self.passed,
                "methods": [asdict(m) for m in self.methods]}


# The reference draws from seeds disjoint from the methods': with shared seeds the samples are dependent
# (the same uniform draws decide both), and the two-sample test, which assumes independence, is invalid.
REFERENCE_SEEDS = 10**7


def run_audit(reference: Sampler, methods: dict[str, Sampler], exact_first: torch.Tensor | None,
              settings: AuditSettings, progress: Callable[[str], None] = lambda _: None) -> AuditReport:
    """Draw from the reference and every method, sized to the budget, and test each position."""
    per_sample = _pilot_seconds({"reference": reference, **methods})
    samples = int(min(settings.samples, settings.budget_s / max(sum(per_sample.values()), 1e-9)))
    if samples < 20:
        raise DraftlabError(f"the budget allows only {samples} samples per method (20 needed); raise --budget")
    tests = len(methods) * settings.positions + (len(methods) if exact_first is not None else 0)
    level = settings.alpha / max(tests, 1)
    progress(f"audit: {samples} samples per method, {len(methods) + 1} methods")
    ref = _draw(reference, samples, settings.positions, first_seed=REFERENCE_SEEDS)
    audits = []
    for name, sampler in methods.items():
        start = time.perf_counter()
        drawn = _draw(sampler, samples, settings.positions)
        checks = [_check(ref, drawn, j, exact_first if j == 0 else None) for j in range(settings.positions)]
        passed = all(c.ok(level) for c in checks)
        audits.append(MethodAudit(name, checks, passed, time.perf_counter() - start))
        progress(f"audit: {name}: {'pass' if passed else 'FAIL'}")
    return AuditReport(samples, level, audits)


def exact_first_distribution(plain: SpeculativeEngine, prompt_ids: Sequence[int], sampling: SamplingConfig
                             ) -> torch.Tensor:
    """The target's warped distribution [V] of the first new token, as `plain` decoding computes it."""
    logits = plain.next_token_logits(prompt_ids)  # [V]
    return logits_to_probs(logits[None].float().cpu(), sampling)[0].double()


def _pilot_seconds(samplers: dict[str, Sampler]) -> dict[str, float]:
    """Seconds per sample of each sampler, from a few untimed-then-timed draws (seeds far from the audit's)."""
    out = {}
    for name, sampler in samplers.items():
        sampler(10**6)
        start = time.perf_counter()
        for seed in range(10**6 + 1, 10**6 + 4):
            sampler(seed)
        out[name] = (time.perf_counter() - start) / 3
    return out


def _draw(sampler: Sampler, samples: int, positions: int, first_seed: int = 0) -> np.ndarray:
    """[samples, positions] token ids from seeds first_seed.. ; END past an early end of sequence."""
    out = np.full((samples, positions), END, dtype=np.int64)
    for row in range(samples):
        tokens = sampler(first_seed + row)[:positions]
        out[row, : len(tokens)] = tokens
    return out


def _check(reference: np.ndarray, drawn: np.ndarray, position: int, exact: torch.Tensor | None) -> PositionCheck:
    """Two-sample test of one position (and, for the first, a test against the exact distribution)."""
    ref, got = reference[:, position], drawn[:, position]
    half = len(ref) // 2
    exact_p = _exact_pvalue(got, exact) if exact is not None else None
    return PositionCheck(position + 1, len(got), _two_sample_pvalue(ref, got), _tvd(ref, got),
                         _tvd(ref[:half], ref[half:]), exact_p)


def _counts(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[2, C] counts over the categories seen in either sample."""
    categories = np.union1d(a, b)
    return np.stack([(a[:, None] == categories).sum(0), (b[:, None] == categories).sum(0)])


def _two_sample_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square test of homogeneity; categories expected < 5 times are pooled into one."""
    table = _counts(a, b)
    expected = table.sum(0) / 2
    rare = expected < 5
    table = np.concatenate([table[:, ~rare], table[:, rare].sum(1, keepdims=True)], axis=1)
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    return float(chi2_contingency(table, correction=False).pvalue)


def _exact_pvalue(drawn: np.ndarray, exact: torch.Tensor) -> float:
    """Chi-square goodness of fit of drawn first tokens against the exact distribution [V]."""
    if (exact[drawn[drawn >= 0]] <= 0).any():
        return 0.0  # a token the target never emits
    expected = exact.numpy() * len(drawn)
    common = np.flatnonzero(expected >= 5)
    observed = np.array([(drawn == t).sum() for t in common] + [(~np.isin(drawn, common)).sum()], dtype=float)
    wanted = np.concatenate([expected[common], [len(drawn) - expected[common].sum()]])
    keep = wanted > 0
    if keep.sum() < 2:
        return 1.0
    return float(chisquare(observed[keep], wanted[keep] * observed[keep].sum() / wanted[keep].sum()).pvalue)


def _tvd(a: np.ndarray, b: np.ndarray) -> float:
    """Total-variation distance between two empirical distributions."""
    table = _counts(a, b).astype(float)
    return float(0.5 * np.abs(table[0] / table[0].sum() - table[1] / table[1].sum()).sum())


def format_audit(report: AuditReport) -> str:
    """A table for people: one row per method and position."""
    lines = [f"{'method':<34}{'pos':>4}{'p-value':>10}{'exact p':>10}{'TVD':>7}{'noise':>7}  verdict",
             f"(n = {report.samples} per method; a test fails below p = {report.level:.1e})"]
    for method in report.methods:
        for c in method.checks:
            exact = f"{c.exact_pvalue:>10.3f}" if c.exact_pvalue is not None else f"{'':>10}"
            lines.append(f"{method.method:<34}{c.position:>4}{c.pvalue:>10.3f}{exact}{c.tvd:>7.3f}{c.noise_tvd:>7.3f}"
                         f"  {'ok' if c.ok(report.level) else 'FAIL'}")
    verdict = "PASS: every draftlab configuration keeps the target's distribution" if report.passed else \
        "FAIL: a draftlab configuration does not keep the target's distribution"
    lines.append(verdict)
    return "\n".join(lines)

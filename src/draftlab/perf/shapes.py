"""Answers for a device from a model's shape, and acceptance measured elsewhere.

A forward pass costs what its shape costs, whatever the weights, and greedy acceptance does not depend on the
hardware. So the seeds' model, tokens/s = TAR / (t_target + t_draft + overhead), can take its two halves from two
places: the target's (and a model draft's) cost per block size timed on this device with random weights in the
model's shape (`calibrate_shape`, no weights needed: a pair whose files never reach the device), and TAR, the
drafted block sizes and the host-side drafting cost per step from a study run anywhere (`Acceptance`, read from its
SpS records by `draftlab.study.answer.transfer`). `predict_from` combines them into a table labelled as predicted, with the profile's device; where
the study ran on the same device, its measured decode tok/s stand beside the prediction, and the error with them.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from draftlab.perf.calibrate import Profile, time_blocks
from draftlab.perf.throughput import DraftProfile, TargetProfile
from draftlab.api import SpeculativeDecoder
from draftlab.backends.fast_llama import FastLlamaBackend
from draftlab.checks.exactness import DTYPES, random_model
from draftlab.decoding.policy import FixedK
from draftlab.drafters import NoDrafter
from draftlab.measure import EncodedPrompt, RunSettings, measure
from draftlab.models import LoadedModel

if TYPE_CHECKING:
    from draftlab.checks.exactness import Shape

BLOCKS = tuple(range(1, 17))  # block sizes timed: one token to 16
TREE_BLOCKS = tuple(range(3, 17))  # tree-shaped blocks timed (two paths from the root; smaller trees are chains)
CONTEXT = 256  # cached tokens the blocks are timed after
PLAIN_STEPS = 24  # one-token steps of the engine timed for its bookkeeping per step


def calibrate_shape(shape: "Shape", dtype: str, device: str, drafts: dict[str, "Shape"], repeats: int = 5,
                    context: int = CONTEXT) -> Profile:
    """The target's block cost curve (1..16 tokens after `context`) and each model draft's cost per token, timed on
    `device` with random weights in the given shapes (`drafts`: drafter spec -> its draft's shape)."""
    started = time.perf_counter()
    model = random_model(shape, DTYPES[dtype], device, layers=shape.depth)  # every layer: the true cost
    backend = FastLlamaBackend(model, device, capacity=context + 64)  # the exact route timed fastest here
    tokens = [(31 * i + 7) % shape.vocab for i in range(context + max(BLOCKS))]
    blocks = time_blocks(backend, tokens[:context], BLOCKS, repeats)
    trees = time_blocks(backend, tokens[:context], TREE_BLOCKS, repeats, tree=True)
    target = TargetProfile(f"shape:{shape.name} {dtype} on {device} ({backend.numerics})", blocks.median_s,
                           _overhead_per_step(model, backend, tokens[:context]), blocks.spread, blocks.drift,
                           trees.median_s)
    costs = [DraftProfile(spec, _draft_cost(draft, dtype, device, tokens[:context], repeats), [])
             for spec, draft in drafts.items()]
    return Profile(target, costs, context, time.perf_counter() - started, device, "fast", backend.numerics)


def _overhead_per_step(model, backend, context: list[int]) -> float:
    """The engine's bookkeeping per step of plain decoding, from its own stopwatch, through the measurement loop."""
    target = LoadedModel("shape", model, None, backend.device, backend.dtype)
    decoder = SpeculativeDecoder(target, NoDrafter(), FixedK(1), backend)
    measured = measure({"plain": decoder}, [EncodedPrompt("context", "shape", context)], RunSettings(PLAIN_STEPS),
                       warmup=1)
    stats = measured.records["plain"][0].stats
    return stats.overhead_s / max(stats.steps, 1)


def _draft_cost(shape: "Shape", dtype: str, device: str, context: list[int], repeats: int) -> float:
    """Seconds a model draft of this shape takes to draft one token (a one-token pass on the draft's products)."""
    backend = FastLlamaBackend(random_model(shape, DTYPES[dtype], device, layers=shape.depth), device,
                               batch_invariant=False,
                               capacity=len(context) + 64)
    return time_blocks(backend, [t % shape.vocab for t in context], [1], repeats).median_s[1]


@dataclass(frozen=True)
class StepCounts:
    """One decode's share of an `Acceptance`: what the engine counted and timed in it."""

    steps: int
    new_tokens: int
    drafted_per_step: tuple[int, ...]
    tree: bool  # some step drafted more than one token on a level
    draft_s: float
    overhead_s: float
    decode_s: float  # the whole call less its prefill


def acceptance(drafter: str, k: int, device: str, decodes: list[StepCounts]) -> "Acceptance":
    """One (draft, K)'s acceptance and host-side costs per step, over its decodes (a study's records or a run's)."""
    steps = sum(d.steps for d in decodes)
    counts = Counter(n for d in decodes for n in d.drafted_per_step)
    total = sum(counts.values()) or 1
    seconds = sum(d.decode_s for d in decodes)
    return Acceptance(drafter, k, sum(d.new_tokens for d in decodes) / steps,
                      tuple((n, c / total) for n, c in sorted(counts.items())),
                      sum(d.draft_s for d in decodes) / steps, sum(d.overhead_s for d in decodes) / steps, steps,
                      sum(d.new_tokens for d in decodes) / seconds if seconds > 0 else 0.0, device,
                      any(d.tree for d in decodes))


@dataclass(frozen=True)
class Acceptance:
    """What a study measured of one (draft, K) on the target, whatever the device: its TAR, the distribution of
    tokens drafted per step, its host-side costs per step, and its decode speed there."""

    drafter: str
    k: int
    tokens_per_step: float
    drafted: tuple[tuple[int, float], ...]  # (tokens drafted in a step, probability)
    draft_s_per_step: float
    overhead_s_per_step: float
    steps: int
    measured_tokens_per_s: float  # decode only (after each prefill), on the study's device
    device: str
    tree: bool = False  # its steps drafted trees (a tree block costs more than a chain of as many tokens)


@dataclass(frozen=True)
class Predicted:
    """One (draft, K) on the profile's device: predicted decode tok/s, and the study's measured beside it."""

    drafter: str
    k: int
    tokens_per_step: float
    t_target_s: float
    t_draft_s: float
    tokens_per_s: float
    speedup: float  # over plain decoding predicted on the same profile
    draft_cost_from: str  # 'profile' (its shape timed on the device) or 'study' (its host-side cost measured there)
    measured_tokens_per_s: float | None  # the study's, when it ran on the profile's device
    tree: bool = False  # a tree's blocks, costed as the profile's tree of as many tokens (or a chain's)

    @property
    def error(self) -> float | None:
        return self.tokens_per_s / self.measured_tokens_per_s - 1 if self.measured_tokens_per_s else None


def predict_from(profile: Profile, cells: list[Acceptance], same_device: bool) -> list[Predicted]:
    """tokens/s = TAR / (E[t_target(1 + drafted)] + overhead + t_draft) per (draft, K): the target's cost from the
    profile, TAR and the drafted sizes from the study; a draft's cost from the profile where it timed the draft's
    shape, else the study's host-side drafting time per step (n-gram and suffix lookups run on the host)."""
    target, plain = profile.target, 1.0 / (profile.target.score_s[1] + profile.target.overhead_s_per_step)
    timed = {d.name: d.draft_s_per_token for d in profile.drafts}
    out = []
    for cell in cells:
        blocks = target.expected_t_tree if cell.tree else target.expected_t_target
        t_target = blocks(list(cell.drafted)) + cell.overhead_s_per_step
        mean_drafted = sum(d * p for d, p in cell.drafted)
        t_draft = timed[cell.drafter] * mean_drafted if cell.drafter in timed else cell.draft_s_per_step
        speed = cell.tokens_per_step / (t_target + t_draft)
        out.append(Predicted(cell.drafter, cell.k, cell.tokens_per_step, t_target, t_draft, speed, speed / plain,
                             "profile" if cell.drafter in timed else "study",
                             cell.measured_tokens_per_s if same_device else None, cell.tree))
    return out


def format_predicted(rows: list[Predicted], profile: Profile, plain_measured: float | None,
                     study_context: int | None = None, measured_in: str = "the study") -> str:
    """The predicted table, labelled with the profile's device; the optimal K and the ranking of drafts; a line when
    the profile was timed at another context than the study's steps saw (`study_context`)."""
    plain = 1.0 / (profile.target.score_s[1] + profile.target.overhead_s_per_step)
    source = "its shape" if profile.target.name.startswith("shape:") else f"the profile ({profile.route or 'timed'})"
    seen = f", whose steps saw ~{study_context} cached tokens" if study_context else ""
    lines = [f"PREDICTED for {profile.target.name} (target cost from {source} after {profile.context_tokens} cached "
             f"tokens, acceptance from the study{seen}):",
             f"  plain decoding {plain:.1f} tok/s" + (f" (measured in {measured_in}: {plain_measured:.1f})"
                                                     if plain_measured else ""),
             f"  {'draft':<34}{'K':>3}{'TAR':>7}{'t_target ms':>13}{'t_draft ms':>12}{'tok/s':>8}{'speedup':>9}"
             f"{'measured':>10}{'error':>8}"]
    for r in rows:
        measured = f"{r.measured_tokens_per_s:.1f}" if r.measured_tokens_per_s else "-"
        error = f"{r.error:+.1%}" if r.error is not None else "-"
        lines.append(f"  {r.drafter:<34}{r.k:>3}{r.tokens_per_step:>7.2f}{1000 * r.t_target_s:>13.2f}"
                     f"{1000 * r.t_draft_s:>12.2f}{r.tokens_per_s:>8.1f}{r.speedup:>8.2f}x{measured:>10}{error:>8}")
    best: dict[str, Predicted] = {}
    for r in rows:
        if r.drafter not in best or r.tokens_per_s > best[r.drafter].tokens_per_s:
            best[r.drafter] = r
    ranking = sorted(best.values(), key=lambda r: -r.tokens_per_s)
    lines.append("  optimal K and ranking: " + "; ".join(f"{r.drafter} K={r.k} ({r.speedup:.2f}x)" for r in ranking))
    if study_context and abs(profile.context_tokens / study_context - 1) > 0.25:
        lines.append(f"  note: the profile was timed after {profile.context_tokens} cached tokens, the study's steps "
                     f"saw ~{study_context} on average: `calibrate ... --context {study_context}` matches it")
    lines.extend(error_lines(rows, plain, plain_measured, measured_in, bool(profile.target.tree_s)))
    return "\n".join(lines)


def error_lines(rows: list[Predicted], plain_predicted: float, plain_measured: float | None,
                measured_in: str = "the study", trees_timed: bool = False) -> list[str]:
    """Against measured tok/s on the same device: the mean error of chain cells and of trees apart (a profile times
    one tree shape per size, or none); and anchored, each prediction scaled by measured over predicted plain
    decoding, which cancels the machine's speed between the profile's run and the study's (a shared host's speed
    drifts by more than 10% from run to run)."""
    lines = []
    for label, group in (("chain", [r for r in rows if not r.tree]), ("tree", [r for r in rows if r.tree])):
        errors = [abs(r.error) for r in group if r.error is not None]
        if not errors:
            continue
        line = (f"  against {measured_in} on this device, {label} cells: mean |error| {statistics.fmean(errors):.1%} "
                f"over {len(errors)}, worst {max(errors):.1%}")
        if plain_measured:
            scale = plain_measured / plain_predicted
            anchored = [(r.error + 1) * scale - 1 for r in group if r.error is not None]  # predicted x scale / measured
            line += (f"; anchored to plain decoding ({scale:.2f}x the profile's speed): mean "
                     f"{statistics.fmean(abs(a) for a in anchored):.1%}")
        if label == "tree":
            line += (" (trees of every shape costed as the profile's two-path tree of as many tokens)" if trees_timed
                     else " (a tree's blocks are costed as chains of as many tokens: the profile timed no trees)")
        lines.append(line)
    return lines

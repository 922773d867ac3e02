"""Answers for a device from a model's shape, and acceptance measured elsewhere.

A forward pass costs what its shape costs, whatever the weights, and greedy acceptance does not depend on the
hardware. So the seeds' model, tokens/s = TAR / (t_target + t_draft + overhead), can take its two halves from two
places: the target's (and a model draft's) cost per block size timed on this device with random weights in the
model's shape (`calibrate_shape`, no weights needed: a pair whose files never reach the device), and TAR, the
drafted block sizes and the host-side drafting cost per step from a study run anywhere (`acceptance_from`, its
SpS records). `predict_from` combines them into a table labelled as predicted, with the profile's device; where
the study ran on the same device, its measured decode tok/s stand beside the prediction, and the error with them.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from draftlab.backends import engine_of_backend
from draftlab.errors import DraftlabError
from draftlab.perf.calibrate import Profile, time_blocks
from draftlab.perf.model import DraftProfile, TargetProfile

if TYPE_CHECKING:
    from draftlab.exactness import Shape

BLOCKS = tuple(range(1, 17))  # block sizes timed: one token to 16
CONTEXT = 256  # cached tokens the blocks are timed after
PLAIN_STEPS = 24  # one-token steps of the engine timed for its bookkeeping per step


def calibrate_shape(shape: "Shape", dtype: str, device: str, drafts: dict[str, "Shape"], repeats: int = 5,
                    context: int = CONTEXT) -> Profile:
    """The target's block cost curve (1..16 tokens after `context`) and each model draft's cost per token, timed on
    `device` with random weights in the given shapes (`drafts`: drafter spec -> its draft's shape)."""
    from draftlab.backends.fast_llama import FastLlamaBackend
    from draftlab.exactness import DTYPES, random_model

    started = time.perf_counter()
    model = random_model(shape, DTYPES[dtype], device, layers=shape.depth)  # every layer: the true cost
    backend = FastLlamaBackend(model, device, capacity=context + 64)  # the exact route timed fastest here
    tokens = [(31 * i + 7) % shape.vocab for i in range(context + max(BLOCKS))]
    blocks = time_blocks(backend, tokens[:context], BLOCKS, repeats)
    target = TargetProfile(f"shape:{shape.name} {dtype} on {device} ({backend.numerics})", blocks.median_s,
                           _overhead_per_step(backend, tokens[:context]), blocks.spread, blocks.drift)
    costs = [DraftProfile(spec, _draft_cost(draft, dtype, device, tokens[:context], repeats), [])
             for spec, draft in drafts.items()]
    return Profile(target, costs, context, time.perf_counter() - started, device)


def _overhead_per_step(backend, context: list[int]) -> float:
    """The engine's bookkeeping per step of plain decoding (its steps' time less their scoring)."""
    from draftlab.drafters import NoDrafter
    from draftlab.engine import GenerationConfig, SpeculativeEngine
    from draftlab.policy import FixedK

    engine = SpeculativeEngine(backend, NoDrafter(), FixedK(1), context_length=len(context) + PLAIN_STEPS + 8)
    stats = engine.generate(context, GenerationConfig(max_new_tokens=PLAIN_STEPS)).stats
    return stats.overhead_s / max(stats.steps, 1)


def _draft_cost(shape: "Shape", dtype: str, device: str, context: list[int], repeats: int) -> float:
    """Seconds a model draft of this shape takes to draft one token (a one-token pass on the draft's products)."""
    from draftlab.backends.fast_llama import FastLlamaBackend
    from draftlab.exactness import DTYPES, random_model

    backend = FastLlamaBackend(random_model(shape, DTYPES[dtype], device, layers=shape.depth), device,
                               batch_invariant=False,
                               capacity=len(context) + 64)
    return time_blocks(backend, [t % shape.vocab for t in context], [1], repeats).median_s[1]


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


def acceptance_from(db) -> tuple[list[Acceptance], dict[str, float]]:
    """The lossless greedy SpS cells of a study, and its plain decoding's decode tok/s per device."""
    from draftlab.study.report import load_study

    rows, _, _ = load_study(db)
    rows = [r for r in rows if (r.get("concurrency") or 1) == 1 and r["temperature"] == 0 and r["wall_s"] > r["prefill_s"]
            and not engine_of_backend(r["backend"]).runs_gguf]  # draftlab's torch engine: what a shape calibrates
    by_cell: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["method"] == "sps" and r["identical"] and r["steps"]:
            by_cell[(r["drafter"], r["k"], r["device"])].append(r)
    cells = [_acceptance(drafter, k, device, its) for (drafter, k, device), its in sorted(by_cell.items())]
    plain = defaultdict(list)
    for r in rows:
        if r["method"] == "ar":
            plain[r["device"]].append(r)
    if not cells:
        raise DraftlabError(f"{db} holds no lossless greedy SpS records: run a study with --methods sps first")
    return cells, {device: _decode_speed(its) for device, its in plain.items()}


def _acceptance(drafter: str, k: int, device: str, rows: list[dict]) -> Acceptance:
    steps = sum(r["steps"] for r in rows)
    counts = Counter(d for r in rows for d in r["drafted_per_step"])
    total = sum(counts.values()) or 1
    return Acceptance(drafter, k, sum(r["new_tokens"] for r in rows) / steps,
                      tuple((d, n / total) for d, n in sorted(counts.items())),
                      sum(r["draft_s"] for r in rows) / steps, sum(r["overhead_s"] for r in rows) / steps, steps,
                      _decode_speed(rows), device)


def _decode_speed(rows: list[dict]) -> float:
    seconds = sum(r["wall_s"] - r["prefill_s"] for r in rows)
    return sum(r["new_tokens"] for r in rows) / seconds if seconds > 0 else 0.0


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
        t_target = target.expected_t_target(list(cell.drafted)) + cell.overhead_s_per_step
        mean_drafted = sum(d * p for d, p in cell.drafted)
        t_draft = timed[cell.drafter] * mean_drafted if cell.drafter in timed else cell.draft_s_per_step
        speed = cell.tokens_per_step / (t_target + t_draft)
        out.append(Predicted(cell.drafter, cell.k, cell.tokens_per_step, t_target, t_draft, speed, speed / plain,
                             "profile" if cell.drafter in timed else "study",
                             cell.measured_tokens_per_s if same_device else None))
    return out


def format_predicted(rows: list[Predicted], profile: Profile, plain_measured: float | None) -> str:
    """The predicted table, labelled with the profile's device; the optimal K and the ranking of drafts."""
    plain = 1.0 / (profile.target.score_s[1] + profile.target.overhead_s_per_step)
    lines = [f"PREDICTED for {profile.target.name} (target cost from the shape, acceptance from the study):",
             f"  plain decoding {plain:.1f} tok/s" + (f" (measured in the study: {plain_measured:.1f})"
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
    errors = [abs(r.error) for r in rows if r.error is not None]
    if errors:
        lines.append(f"  against the study on this device: mean |error| {statistics.fmean(errors):.1%} over "
                     f"{len(errors)} cells, worst {max(errors):.1%}")
    return "\n".join(lines)

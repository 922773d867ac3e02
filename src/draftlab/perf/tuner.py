"""Validate the performance model against measured sweeps, and pick draft and K for a user.

`validate` compares each formula's predicted decode throughput with the
throughput measured in a study database (decode only: new tokens over wall
time minus prefill, since neither formula models prefill). `tune` calibrates,
predicts every (draft, K), confirms the best with a short measured run, and
prints how to use it in draftlab, HF transformers, vLLM and llama.cpp.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from draftlab.api import parse_drafter_spec
from draftlab.perf.calibrate import CalibrationSettings, Profile, calibrate
from draftlab.datasets import Prompt
from draftlab.errors import DraftlabError
from draftlab.models import LoadedModel
from draftlab.perf.model import Prediction, predict


def predictions(profile: Profile, k_max: int | None = None) -> list[Prediction]:
    """Both formulas for every draft in the profile and every K up to its K_max."""
    out = []
    for draft in profile.drafts:
        for k in range(1, min(k_max or draft.k_max, draft.k_max) + 1):
            out.append(predict(profile.target, draft, k))
    return out


def format_predictions(preds: list[Prediction], ar_tokens_per_s: float) -> str:
    """A table of predicted tokens/s and speedup per draft and K, with the inputs."""
    lines = [f"autoregressive (predicted): {ar_tokens_per_s:.1f} tokens/s",
             f"{'draft':<18}{'K':>3}{'TAR':>6}{'t_target ms':>12}{'t_draft ms':>11}{'tok/s':>8}{'speedup':>9}"
             f"{'a':>7}{'c':>7}{'Leviathan':>11}"]
    for p in preds:
        lines.append(
            f"{p.draft:<18}{p.k:>3}{p.tokens_per_step:>6.2f}{1000 * p.t_target:>12.1f}{1000 * p.t_draft:>11.1f}"
            f"{p.tokens_per_s:>8.1f}{p.speedup:>8.2f}x{p.leviathan_acceptance:>7.2f}{p.leviathan_c:>7.3f}"
            f"{p.leviathan_speedup:>10.2f}x"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Comparison:
    """One sweep cell: measured decode throughput against both formulas."""

    draft: str
    k: int
    measured_tokens_per_s: float
    simplified_tokens_per_s: float
    leviathan_tokens_per_s: float

    @property
    def simplified_error(self) -> float:
        return abs(self.simplified_tokens_per_s - self.measured_tokens_per_s) / self.measured_tokens_per_s

    @property
    def leviathan_error(self) -> float:
        return abs(self.leviathan_tokens_per_s - self.measured_tokens_per_s) / self.measured_tokens_per_s


def measured_decode_throughput(rows: list[dict]) -> dict[tuple[str, int], float]:
    """Decode tokens/s (prefill excluded) of every sps cell, over all its datasets."""
    tokens: dict[tuple, int] = defaultdict(int)
    seconds: dict[tuple, float] = defaultdict(float)
    for r in rows:
        if r["method"] == "sps":
            tokens[(r["drafter"], r["k"])] += r["new_tokens"]
            seconds[(r["drafter"], r["k"])] += r["wall_s"] - r["prefill_s"]
    return {key: tokens[key] / seconds[key] for key in tokens if seconds[key] > 0}


def compare(profile: Profile, rows: list[dict]) -> list[Comparison]:
    """Predicted vs measured for every sps cell whose draft the profile knows."""
    drafts = {d.name: d for d in profile.drafts}
    out = []
    for (draft, k), measured in sorted(measured_decode_throughput(rows).items()):
        if draft in drafts and k <= drafts[draft].k_max:
            p = predict(profile.target, drafts[draft], k)
            out.append(Comparison(draft, k, measured, p.tokens_per_s, p.leviathan_tokens_per_s))
    if not out:
        raise DraftlabError("no sps cell of the study matches a draft of the profile; calibrate the same drafts")
    return out


def error_summary(comparisons: list[Comparison]) -> dict:
    """Mean and maximum relative error of each formula."""
    simple = [c.simplified_error for c in comparisons]
    lev = [c.leviathan_error for c in comparisons]
    return {
        "cells": len(comparisons),
        "simplified_mean_error": statistics.mean(simple), "simplified_max_error": max(simple),
        "leviathan_mean_error": statistics.mean(lev), "leviathan_max_error": max(lev),
    }


def plot_comparison(comparisons: list[Comparison], path: Path) -> None:
    """Predicted vs measured throughput, both formulas, with the y = x line (the study's Figure 12)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    measured = [c.measured_tokens_per_s for c in comparisons]
    ax.scatter(measured, [c.simplified_tokens_per_s for c in comparisons], label="TAR / (t_target + t_draft)")
    ax.scatter(measured, [c.leviathan_tokens_per_s for c in comparisons], marker="x", label="Leviathan et al.")
    top = max(measured + [c.simplified_tokens_per_s for c in comparisons] + [c.leviathan_tokens_per_s for c in comparisons])
    ax.plot([0, top * 1.05], [0, top * 1.05], "k:", label="predicted = measured")
    ax.set_xlabel("measured decode throughput (tokens/s)")
    ax.set_ylabel("predicted throughput (tokens/s)")
    ax.set_title("Performance model vs measurement", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def required_tar(target_tokens_per_s: float, t_target: float, t_draft: float) -> float:
    """TAR a draft needs to reach a throughput goal (the study's Figure 11): goal x (t_target + t_draft)."""
    return target_tokens_per_s * (t_target + t_draft)


def latency_reduction_for_parity(tar: float, t_target: float, t_draft: float, best_tokens_per_s: float) -> float:
    """Fraction of its drafting time a draft must shed to match `best_tokens_per_s` (the study's Table 5).

    Solves TAR / (t_target + x t_draft) = best for x; returns 1 - x (above 1: unreachable even at zero cost).
    """
    if t_draft <= 0:
        return 0.0
    needed_draft_time = tar / best_tokens_per_s - t_target
    return 1.0 - needed_draft_time / t_draft


def extra_tar_for_parity(tar: float, t_target: float, t_draft: float, best_tokens_per_s: float) -> float:
    """TAR a draft must add to match `best_tokens_per_s` at its current latency (the study's Figure 7)."""
    return required_tar(best_tokens_per_s, t_target, t_draft) - tar


def format_what_if(preds: list[Prediction]) -> str:
    """For each draft at its best K: what it would take to match the best draft (Table 5, Figure 7)."""
    best_per_draft: dict[str, Prediction] = {}
    for p in preds:
        if p.draft not in best_per_draft or p.tokens_per_s > best_per_draft[p.draft].tokens_per_s:
            best_per_draft[p.draft] = p
    best = max(best_per_draft.values(), key=lambda p: p.tokens_per_s)
    lines = [f"what it takes to match the best draft ({best.draft} K={best.k}, {best.tokens_per_s:.1f} tokens/s):",
             f"{'draft':<18}{'K':>3}{'tok/s':>8}{'draft latency cut':>19}{'or extra TAR':>14}"]
    for p in sorted(best_per_draft.values(), key=lambda p: -p.tokens_per_s):
        cut = latency_reduction_for_parity(p.tokens_per_step, p.t_target, p.t_draft, best.tokens_per_s)
        extra = extra_tar_for_parity(p.tokens_per_step, p.t_target, p.t_draft, best.tokens_per_s)
        cut_text = f"{cut:.0%}" if cut <= 1 else "unreachable"
        extra_text = f"+{extra:.2f}" if p.tokens_per_step + extra <= p.k + 1 else f"+{extra:.2f} (> K+1)"
        lines.append(f"{p.draft:<18}{p.k:>3}{p.tokens_per_s:>8.1f}{cut_text:>19}{extra_text:>14}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Recommendation:
    """The tuner's choice, its predicted and measured speed, and how long tuning took."""

    draft: str
    k: int
    predicted_tokens_per_s: float
    predicted_speedup: float
    measured_tokens_per_s: float | None
    measured_speedup: float | None
    seconds: float


def choose(preds: list[Prediction]) -> Prediction | None:
    """The fastest predicted configuration; None when nothing beats autoregressive decoding."""
    best = max(preds, key=lambda p: p.tokens_per_s, default=None)
    return best if best is not None and best.speedup > 1.0 else None


def tune(target: LoadedModel, drafters: list[str], prompts: list[Prompt], settings: CalibrationSettings,
         confirm: bool = True, progress: bool = True) -> tuple[Recommendation, Profile, list[Prediction]]:
    """Calibrate, predict, choose, and confirm on the same prompts with a short measured run."""
    from draftlab.api import SpeculativeDecoder
    from draftlab.bench import BenchSettings, run_bench

    start = time.perf_counter()
    profile = calibrate(target, drafters, prompts, settings, progress)
    preds = predictions(profile)
    best = choose(preds)
    if best is None:
        return Recommendation("none", 0, profile.target.autoregressive_tokens_per_s, 1.0, None, None,
                              time.perf_counter() - start), profile, preds
    measured = None
    if confirm:
        decoder = SpeculativeDecoder.from_names(target, drafter=best.draft, k=best.k, backend=settings.backend)
        measured = run_bench(decoder, prompts, BenchSettings(max_new_tokens=settings.max_new_tokens, warmup=0),
                             progress=progress).summary()
    return Recommendation(
        best.draft, best.k, best.tokens_per_s, best.speedup,
        measured["tokens_per_s"] if measured else None, measured["speedup"] if measured else None,
        time.perf_counter() - start,
    ), profile, preds


def usage(target: str, draft: str, k: int) -> list[str]:
    """How to run the recommendation in draftlab, HF transformers, vLLM and llama.cpp."""
    if draft == "none":
        return ["speculative decoding is not predicted to help here: decode autoregressively"]
    plan = parse_drafter_spec(draft)
    lines = [f"draftlab:     draftlab generate --target {target} --drafter {draft} --k {k} --prompt ..."]
    if plan.kind == "ngram":
        low, high = plan.ngram
        lines += [
            f"transformers: model.generate(..., prompt_lookup_num_tokens={k}, max_matching_ngram_size={high})",
            f'vLLM:         speculative_config={{"method": "ngram", "num_speculative_tokens": {k}, '
            f'"prompt_lookup_max": {high}, "prompt_lookup_min": {low}}}',
            f"llama.cpp:    llama-lookup -m TARGET.gguf --draft {k}  (prompt-lookup decoding)",
        ]
    elif plan.kind == "model":
        lines += [
            f"transformers: draft.generation_config.num_assistant_tokens = {k}; "
            'draft.generation_config.num_assistant_tokens_schedule = "constant"; '
            "model.generate(..., assistant_model=draft)",
            f'vLLM:         speculative_config={{"model": "{plan.model}", "num_speculative_tokens": {k}}}',
            f"llama.cpp:    llama-speculative -m TARGET.gguf -md DRAFT.gguf --draft {k}",
        ]
    else:
        lines += [
            "transformers: build the layer draft with draftlab.build_layer_draft(target, layers) and pass it as "
            f"assistant_model with num_assistant_tokens={k} (constant schedule)",
            "vLLM / llama.cpp: no layer self-draft; save the draft as a model to use it there",
        ]
    return lines

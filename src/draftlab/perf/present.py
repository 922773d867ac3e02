"""What the model's numbers mean to a user: the predicted-vs-measured plot, what-if tables, and how to run a pick.

`usage` prints how to run a chosen (draft, K) in draftlab, HF transformers,
vLLM and llama.cpp.
"""

from __future__ import annotations

from pathlib import Path

from draftlab.api import parse_drafter_spec
from draftlab.drafters import feature, heads
from draftlab.drafters.files import draft_format
from draftlab.perf.throughput import Prediction
from draftlab.perf.validate import Comparison
from draftlab.drafters.kinds import is_plain_drafter


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


def usage(target: str, draft: str, k: int) -> list[str]:
    """How to run the recommendation in draftlab, HF transformers, vLLM and llama.cpp."""
    if is_plain_drafter(draft):
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
    elif plan.kind == "suffix":
        o = plan.suffix
        lines += [
            f'vLLM:         speculative_config={{"method": "suffix", "num_speculative_tokens": {k}, '
            f'"suffix_decoding_max_tree_depth": {o.depth}, "suffix_decoding_max_spec_factor": {o.factor}, '
            f'"suffix_decoding_min_token_prob": {o.min_prob}, "suffix_decoding_max_cached_requests": {o.responses}}}',
            "transformers: no suffix decoding (prompt_lookup_num_tokens is the per-request n-gram lookup); "
            "llama.cpp: its --spec-type ngram-cache keeps a cross-request n-gram cache, not suffix trees",
        ]
    elif plan.kind == "model" and draft_format(plan.model) == heads.FORMAT:
        lines += ["transformers / llama.cpp: no decoder heads; vLLM: its Medusa method, with the heads converted "
                  "to Medusa's checkpoint format"]
    elif plan.kind == "designed" or (plan.kind == "model" and draft_format(plan.model) == feature.FORMAT):
        lines += ["transformers / llama.cpp: no feature drafts that read the target's hidden states; "
                  "vLLM: its EAGLE method, with the draft converted to EAGLE's checkpoint format"]
    elif plan.kind == "model":
        lines += [
            f"transformers: draft.generation_config.num_assistant_tokens = {k}; "
            'draft.generation_config.num_assistant_tokens_schedule = "constant"; '
            "model.generate(..., assistant_model=draft)",
            f'vLLM:         speculative_config={{"model": "{plan.model}", "num_speculative_tokens": {k}}}',
            f"llama.cpp:    llama-speculative -m TARGET.gguf -md DRAFT.gguf --draft {k}",
        ]
    elif plan.kind in ("tree", "merged"):
        lines += ["transformers / llama.cpp: no token trees (the chain of the same draft runs there); "
                  "vLLM: tree attention only for its EAGLE drafts"]
    elif plan.kind == "staged":
        lines += ["transformers / vLLM / llama.cpp: no staged drafting; the inner draft alone drafts the same "
                  "tokens (greedy) there, one pass per token"]
    else:
        lines += [
            "transformers: build the layer draft with draftlab.build_layer_draft(target, layers) and pass it as "
            f"assistant_model with num_assistant_tokens={k} (constant schedule)",
            "vLLM / llama.cpp: no layer self-draft; save the draft as a model to use it there",
        ]
    return lines

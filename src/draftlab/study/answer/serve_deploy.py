"""The study's answer as a `draftlab serve` command, where draftlab's own server wins.

Over all of a target's prompts: draftlab serve's fastest exact configuration alone (plain decoding, or a drafter whose
every greedy output equalled draftlab's plain decoding) against the fastest llama-server configuration alone. Where
draftlab serve is ahead by more than the study's drift, the Deploy line is its command, with K per requests in
flight: at each level measured, the drafter's fastest K where it beats draftlab serve's own plain decoding there,
else 0 (plain decoding), in `--k-per-load` rows.
"""

from __future__ import annotations

from collections import defaultdict

from draftlab.contenders.draftlab_serve import SERVE, SERVE_AR, ServeConfig
from draftlab.contenders.methods import method_of
from draftlab.study.answer.report import ALL
from draftlab.study.answer.serving import LoadSummary
from draftlab.study.run.cells import LLAMACPP_TARGET


def serve_sentences(summaries: list[LoadSummary], margin: float = 0.0) -> list[str]:
    """Per target where draftlab serve ran and beat llama-server alone: one Deploy line."""
    by_target: dict[tuple, list[LoadSummary]] = defaultdict(list)
    for s in summaries:
        if s.dataset == ALL:
            by_target[(s.target, s.temperature)].append(s)
    lines = []
    for (target, _), cells in sorted(by_target.items()):
        most = max(s.prompts for s in cells)
        cells = [s for s in cells if s.prompts == most and s.tokens_per_s > 0]
        line = _deploy_line(target.removeprefix(LLAMACPP_TARGET), cells, margin)
        if line:
            lines.append(line)
    return lines


def _deploy_line(model: str, cells: list[LoadSummary], margin: float) -> str:
    alone = [s for s in cells if s.concurrency == 1]
    ours = [s for s in alone if _exact_serve(s)]
    rivals = [s for s in alone if method_of(s.method).served and s.method not in (SERVE.name, SERVE_AR.name)]
    if not ours or not rivals:
        return ""
    best, rival = max(ours, key=lambda s: s.tokens_per_s), max(rivals, key=lambda s: s.tokens_per_s)
    if best.tokens_per_s <= rival.tokens_per_s * (1 + margin):
        return ""
    rows = _k_per_load(best, cells, margin)
    levels = sorted({s.concurrency for s in cells if s.method == SERVE_AR.name})
    config = ServeConfig(model, best.drafter if best.method == SERVE.name else "none", rows, slots=max(levels))
    return (f"Deploy {model} on draftlab serve (exact: every output as draftlab's plain decoding, at every load; "
            f"{best.name} {best.tokens_per_s:.1f} tok/s alone, {best.tokens_per_s / rival.tokens_per_s:.2f}x "
            f"{rival.name}'s {rival.tokens_per_s:.1f}) with: {config.command()}")


def _exact_serve(s: LoadSummary) -> bool:
    """draftlab serve's plain decoding, or its speculation with every greedy output equal to draftlab's plain."""
    if s.method == SERVE_AR.name:
        return True
    return s.method == SERVE.name and (s.as_reference is None or s.as_reference == s.prompts)


def _k_per_load(best: LoadSummary, cells: list[LoadSummary], margin: float) -> str:
    """`--k-per-load` rows: per level measured, the fastest exact K of the chosen drafter over draftlab serve's plain
    decoding at that level by more than `margin`, else 0."""
    levels = sorted({s.concurrency for s in cells if s.method == SERVE_AR.name})
    ks = []
    for level in levels:
        plain = next(s for s in cells if s.method == SERVE_AR.name and s.concurrency == level)
        same = [s for s in cells if s.method == SERVE.name and s.drafter == best.drafter and s.concurrency == level
                and _exact_serve(s)]
        fastest = max(same, key=lambda s: s.tokens_per_s, default=None)
        paying = fastest is not None and best.method == SERVE.name and \
            fastest.tokens_per_s > plain.tokens_per_s * (1 + margin)
        ks.append(fastest.k if paying else 0)
    rows, low = [], 1
    for i, (level, k) in enumerate(zip(levels, ks)):
        high = level if i + 1 < len(levels) else max(level, 64)
        if rows and rows[-1][2] == k:
            rows[-1][1] = high
        else:
            rows.append([low, high, k])
        low = high + 1
    return ",".join(f"{lo}-{hi}:{k}" if hi > lo else f"{lo}:{k}" for lo, hi, k in rows)

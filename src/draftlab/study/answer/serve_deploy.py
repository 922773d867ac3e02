"""The study's answer as a `draftlab serve` command, where draftlab's own server wins.

Over all of a target's prompts: draftlab serve's fastest exact configuration alone (plain decoding, or a drafter whose
every greedy output equalled draftlab's plain decoding) against the fastest llama-server configuration alone. Where
draftlab serve is ahead by more than the study's drift, the Deploy line is its command, for as many requests in
flight as the study measured (`--max-in-flight`): with `--k auto` (K chosen each step) where the study raced it
and at every level it kept within the drift of the fastest of that drafter's fixed K and plain decoding there; else
with K per requests in flight (`load_rows`): at each level, the drafter's fastest K or `--k auto` where it beats
draftlab serve's own plain decoding there by more than the drift, else `auto` where that kept within the drift of
plain decoding (it falls to plain decoding where drafts do not pay), else 0 (plain decoding), in `--k-per-load` rows
(`1:3,2-64:auto`, `rows_by_level`). A Deploy line whose answer was measured on draftlab's own loop keeps the Use
line's K alone and takes its rows above one request from the drafter's served cells (`drafter_rows`).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from draftlab.contenders.draftlab_serve import SERVE, SERVE_AR, SERVE_DEPLOY, ServeConfig
from draftlab.contenders.methods import method_of
from draftlab.decoding.kchoice import AUTO, rows_by_level
from draftlab.drafters.kinds import serves_batched
from draftlab.errors import DraftlabError
from draftlab.study.answer.report import ALL
from draftlab.study.answer.serving import LoadSummary
from draftlab.study.run.cells import LLAMACPP_TARGET


def serve_sentences(summaries: list[LoadSummary], margin: float = 0.0) -> list[str]:
    """Per target where draftlab serve ran and beat llama-server alone: one Deploy line."""
    lines = []
    for (target, _), cells in sorted(_complete_cells(summaries).items()):
        line = _deploy_line(target.removeprefix(LLAMACPP_TARGET), cells, margin)
        if line:
            lines.append(line)
    return lines


def serve_configs(summaries: list[LoadSummary], margin: float = 0.0) -> dict[str, ServeConfig]:
    """Per target's model (`NAME@TYPE`) where draftlab serve ran: its fastest exact configuration alone, with K per
    requests in flight (whether or not it beat llama-server)."""
    found = {}
    for (target, _), cells in sorted(_complete_cells(summaries).items()):
        best = _best_alone(cells)
        if best is not None:
            found[target.removeprefix(LLAMACPP_TARGET)] = _config(target.removeprefix(LLAMACPP_TARGET), best, cells,
                                                                  margin)
    return found


def _complete_cells(summaries: list[LoadSummary]) -> dict[tuple, list[LoadSummary]]:
    """Over all the study's prompts, per (target, temperature): the cells that ran the most prompts."""
    by_target: dict[tuple, list[LoadSummary]] = defaultdict(list)
    for s in summaries:
        if s.dataset == ALL:
            by_target[(s.target, s.temperature)].append(s)
    out = {}
    for key, cells in by_target.items():
        most = max(s.prompts for s in cells)
        out[key] = [s for s in cells if s.prompts == most and s.tokens_per_s > 0]
    return out


def _best_alone(cells: list[LoadSummary]) -> LoadSummary | None:
    return max((s for s in cells if s.concurrency == 1 and _exact_serve(s)), key=lambda s: s.tokens_per_s,
               default=None)


def _config(model: str, best: LoadSummary, cells: list[LoadSummary], margin: float) -> ServeConfig:
    """The configuration to deploy: the best one's drafter with K per load (plain decoding where no level pays)."""
    levels = sorted({s.concurrency for s in cells if s.method == SERVE_AR.name}) or [1]
    if best.method == SERVE.name and _auto_holds(best.drafter, cells, levels, margin):
        return ServeConfig(model, best.drafter, "auto", slots=max(levels), name="")
    paying = best.method == SERVE.name and any(_paying(best.drafter, cells, level, margin) for level in levels)
    rows = load_rows(best.drafter, cells, margin) if paying else "1:0"
    return ServeConfig(model, best.drafter if paying else "none", rows, slots=max(levels), name="")


def drafter_rows(summaries: list[LoadSummary], margin: float = 0.0) -> dict[tuple[str, str], dict[int, int]]:
    """Per (model `NAME@TYPE`, drafter) draftlab serve ran: the K each level measured gives it (`_level_k`), by
    requests in flight."""
    found = {}
    for (target, _), cells in sorted(_complete_cells(summaries).items()):
        model = target.removeprefix(LLAMACPP_TARGET)
        for drafter in sorted({s.drafter for s in cells if s.method == SERVE.name}):
            found[(model, drafter)] = {level: _level_k(drafter, cells, level, margin) for level in _levels(cells)}
    return found


def _auto_holds(drafter: str, cells: list[LoadSummary], levels: list[int], margin: float) -> bool:
    """Whether the drafter's `--k auto` ran exact at every level measured, within `margin` of the fastest of plain
    decoding and the drafter's fixed K there."""
    for level in levels:
        here = [s for s in cells if s.concurrency == level and _exact_serve(s)
                and (s.method == SERVE_AR.name or s.drafter == drafter)]
        auto = [s for s in here if s.method == SERVE.name and s.k == 0]
        if not auto or auto[0].tokens_per_s * (1 + margin) < max(s.tokens_per_s for s in here):
            return False
    return True


def _deploy_line(model: str, cells: list[LoadSummary], margin: float) -> str:
    """A `draftlab serve` Deploy line where the configuration it deploys beat llama-server's fastest alone by more
    than `margin`, citing that configuration's own figure (its plain decoding's where no K paid over it)."""
    best = _best_alone(cells)
    rivals = [s for s in cells if s.concurrency == 1 and method_of(s.method).served
              and s.method not in (SERVE.name, SERVE_AR.name)]
    if best is None or not rivals:
        return ""
    config = _config(model, best, cells, margin)
    shown = best if config.drafter == best.drafter else _plain_alone(cells)
    rival = max(rivals, key=lambda s: s.tokens_per_s)
    if shown is None or shown.tokens_per_s <= rival.tokens_per_s * (1 + margin):
        return ""
    return (f"Deploy {model} {SERVE_DEPLOY} (exact: every output as draftlab's plain decoding, at every load; "
            f"{shown.name} {shown.tokens_per_s:.1f} tok/s alone, {shown.tokens_per_s / rival.tokens_per_s:.2f}x "
            f"{rival.name}'s {rival.tokens_per_s:.1f}) with: {config.command()}")


def _plain_alone(cells: list[LoadSummary]) -> LoadSummary | None:
    """draftlab serve's plain decoding alone."""
    return next((s for s in cells if s.method == SERVE_AR.name and s.concurrency == 1), None)


def _exact_serve(s: LoadSummary) -> bool:
    """draftlab serve's plain decoding, or its speculation with every greedy output equal to draftlab's plain."""
    if s.method == SERVE_AR.name:
        return True
    return s.method == SERVE.name and (s.as_reference is None or s.as_reference == s.prompts)


def load_rows(drafter: str, cells: list[LoadSummary], margin: float) -> str:
    """`--k-per-load` rows for the drafter: each level measured, its K there (`_level_k`)."""
    return rows_by_level({level: _level_k(drafter, cells, level, margin) for level in _levels(cells)})


def _levels(cells: list[LoadSummary]) -> list[int]:
    return sorted({s.concurrency for s in cells if s.method == SERVE_AR.name}) or [1]


def _level_k(drafter: str, cells: list[LoadSummary], level: int, margin: float) -> int:
    """The drafter's K at one level: its fastest exact fixed K or `--k auto` (`AUTO`) where that beats draftlab
    serve's plain decoding there by more than `margin` (`_paying`); else `AUTO` where `--k auto` ran within `margin`
    of plain decoding; else 0."""
    paying = _paying(drafter, cells, level, margin)
    if paying is not None:
        return paying.k or AUTO
    plain = _plain_at(cells, level)
    auto = next((s for s in _served(drafter, cells, level) if s.k == 0), None)
    return AUTO if plain and auto and auto.tokens_per_s * (1 + margin) >= plain.tokens_per_s else 0


def _paying(drafter: str, cells: list[LoadSummary], level: int, margin: float) -> LoadSummary | None:
    """The drafter's fastest exact cell at the level (a fixed K, or K 0: `--k auto`) where it beats draftlab serve's
    plain decoding there by more than `margin`."""
    plain = _plain_at(cells, level)
    fastest = max(_served(drafter, cells, level), key=lambda s: s.tokens_per_s, default=None)
    paying = plain is not None and fastest is not None and fastest.tokens_per_s > plain.tokens_per_s * (1 + margin)
    return fastest if paying else None


def _served(drafter: str, cells: list[LoadSummary], level: int) -> list[LoadSummary]:
    return [s for s in cells if s.method == SERVE.name and s.drafter == drafter and s.concurrency == level
            and _exact_serve(s)]


def _plain_at(cells: list[LoadSummary], level: int) -> LoadSummary | None:
    return next((s for s in cells if s.method == SERVE_AR.name and s.concurrency == level), None)


def serve_from_study(directory: str | Path, target: str | None = None) -> ServeConfig:
    """What `draftlab serve --from DIR` serves: the study's draftlab serve answer where it raced one, else its fastest
    exact configuration on a llama.cpp target that the server runs (ngram, suffix, a draft model; K for every load), else plain
    decoding there; `target` picks among the study's models."""
    from draftlab.study.answer.results import StudyResults

    return serve_answer(StudyResults.load(Path(directory) / "study.sqlite"), target, f"the study in {directory}")


def serve_answer(results, target: str | None = None, where: str = "the study") -> ServeConfig:
    """`serve_from_study` of a study's loaded results (`StudyResults`)."""
    from draftlab.study.answer.recommend import fastest_lossless

    raced = serve_configs(results.load_summaries, results.drift.typical)
    on_llamacpp = [s for s in results.summaries if s.target.startswith(LLAMACPP_TARGET)]
    answers = {**{d.target: ServeConfig(d.target, d.draft if serves_batched(d.draft) else "none",
                                        f"1:{d.k if serves_batched(d.draft) else 0}", name="")
                  for d in fastest_lossless(on_llamacpp)}, **raced}
    if not answers:
        raise DraftlabError(f"{where} ran no llama.cpp target: draftlab serve runs GGUF targets "
                            "(study one with --targets llamacpp:NAME)")
    if target is None:
        return next(iter(answers.values()))
    if target not in answers:
        raise DraftlabError(f"{where} has no answer for {target}; it has {', '.join(answers)}")
    return answers[target]

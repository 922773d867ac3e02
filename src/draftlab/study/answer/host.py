"""Each cell against the plain decoding of its model that the host runs fastest, whatever the engine, with a
paired interval.

A cell of the same target as that plain decoding (the same engine's loop: draftlab's llama.cpp, llama-cpp-python
and llama-server share the llama.cpp target's prompts and its baseline's re-timings) is compared through the
baseline: per prompt, its speedup over the baseline at its time over the plain decoding's at its own, which
cancels the host's drift between the two runs. A cell of another target (the torch backend against llama.cpp) is
compared by decode tokens/s on each prompt both ran. Either way the interval is t on the logs of the per-prompt
ratios (`draftlab.perf.baselines.interval`).

Plain decodings that tie are told apart by where they deploy: llama-server's plain decoding is the reference
unless another is surely faster (llama-server's paired interval against it lies below 1.0x), since the study's
Deploy line is llama-server's.
"""

from __future__ import annotations

from collections import defaultdict

from draftlab.contenders.methods import AR, is_baseline, method_of
from draftlab.perf.baselines import interval
from draftlab.study.run.race import model_of
from draftlab.study.answer.summary import CellSummary, engine_words, pace, plain_label

PromptPaces = dict[tuple, tuple[float, float]]  # (dataset, prompt id) -> (decode tok/s, speedup over its baseline)


def add_host_speedups(summaries: list[CellSummary], per_prompt: dict[tuple, PromptPaces]) -> None:
    """Set each cell's `host_speedup` (with `host_low`-`host_high`) over its model's reference plain decoding.
    `per_prompt`: (config key, dataset) -> that summary's per-prompt paces."""
    groups: dict[tuple, list[CellSummary]] = defaultdict(list)
    for s in summaries:
        if method_of(s.method).plain and s.speedup > 0 and s.complete:
            groups[_group(s)].append(s)
    references = {key: _reference(cells, per_prompt) for key, cells in groups.items()}
    for s in summaries:
        best = references.get(_group(s))
        if best is None or s.speedup <= 0:
            continue
        s.host_speedup, ratios = _paired(s, best, per_prompt)
        s.host_low, s.host_high = interval(s.host_speedup, ratios) if ratios else _scaled(s)
        s.host_plain = AR.name if best.target == s.target and is_baseline(best.method) else plain_label(best)
        s.host_engine = engine_words(best)
        s.host_reference = s is best


def _scaled(s: CellSummary) -> tuple[float, float]:
    """Without per-prompt paces (a summary built by hand): its own paired interval, scaled to its host speedup."""
    scale = s.host_speedup / s.speedup
    return s.speedup_low * scale, s.speedup_high * scale


def _group(s: CellSummary) -> tuple:
    return (model_of(s.target), s.dataset, s.temperature)


def _reference(plains: list[CellSummary], per_prompt: dict[tuple, PromptPaces]) -> CellSummary:
    """The plain decoding a model's cells are judged against: the one that decodes fastest, or the fastest served
    one (llama-server's, vLLM's: what users deploy) when the fastest is not surely faster than it."""
    fastest = max(plains, key=pace)
    served = max((s for s in plains if method_of(s.method).served), key=pace, default=None)
    if served is not None and served is not fastest:
        point, ratios = _paired(served, fastest, per_prompt)
        if interval(point, ratios)[1] >= 1.0:
            return served
    return fastest


def _paired(s: CellSummary, best: CellSummary, per_prompt: dict[tuple, PromptPaces]) -> tuple[float, list[float]]:
    """`s` over `best`: the point and the per-prompt ratios on the prompts both ran (through their shared baseline
    when they are of one target, else by decode tokens/s)."""
    ours, theirs = per_prompt.get(_key(s), {}), per_prompt.get(_key(best), {})
    shared = sorted(set(ours) & set(theirs))
    if best.target == s.target:
        return s.speedup / best.speedup, [ours[p][1] / theirs[p][1] for p in shared if theirs[p][1] > 0]
    return pace(s) / pace(best), [ours[p][0] / theirs[p][0] for p in shared if theirs[p][0] > 0]


def _key(s: CellSummary) -> tuple:
    return (*s.config_key, s.dataset)

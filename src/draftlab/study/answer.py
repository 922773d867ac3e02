"""The study's answer across engines: the fastest lossless way to decode a model measured on this machine."""

from __future__ import annotations

from collections import defaultdict

from draftlab.study.report import ALL, METHOD_NAMES, PLAIN_METHODS, CellSummary
from draftlab.study.store import LLAMACPP_TARGET


def engine_answer(summaries: list[CellSummary]) -> list[str]:
    """One sentence per model and temperature measured on more than one engine: the fastest lossless way to decode
    it on this machine (engine, and draft and K or plain decoding), beside each engine's plain decoding."""
    groups: dict[tuple, list[CellSummary]] = defaultdict(list)
    for s in summaries:
        if s.dataset == ALL and s.tokens_per_s > 0 and not s.lossy:
            groups[(s.target.removeprefix(LLAMACPP_TARGET), s.temperature)].append(s)
    temperatures = defaultdict(set)
    for model, temperature in groups:
        temperatures[model].add(temperature)
    sentences = []
    for (model, temperature), cells in sorted(groups.items()):
        plain = {}
        for s in cells:
            if s.method in PLAIN_METHODS:
                plain[_engine(s)] = max(plain.get(_engine(s), 0.0), s.tokens_per_s)
        if len(plain) < 2:
            continue
        best = max(cells, key=lambda s: s.tokens_per_s)
        what = "plain decoding" if best.method in PLAIN_METHODS else (
            f"{best.drafter} at K={best.k} ({METHOD_NAMES.get(best.method, best.method)})")
        at = f" at temperature {temperature:g}" if len(temperatures[model]) > 1 else ""
        engines = ", ".join(f"{engine} {speed:.1f}" for engine, speed in sorted(plain.items(), key=lambda e: -e[1]))
        sentences.append(f"Fastest measured for {model}{at} on this machine: {what} on {_engine(best)}, "
                         f"{best.tokens_per_s:.1f} tok/s over {best.prompts} prompts (plain decoding, tok/s: {engines}).")
    return sentences


def _engine(s: CellSummary) -> str:
    """The engine a cell ran on, in words."""
    on_llamacpp = s.backend == "llamacpp" or s.target.startswith(LLAMACPP_TARGET)
    if on_llamacpp or s.drafter.startswith("llama.cpp") or s.method in ("lcp", "llama"):
        return "llama.cpp (llama-cpp-python)" if s.method in ("lcp", "llama") else "llama.cpp (draftlab)"
    if s.method in ("asg", "hf"):
        return "HF transformers"
    return f"draftlab's torch backend ({s.drafter})" if s.method == "plain" else "draftlab's torch backend"

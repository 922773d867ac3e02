"""The study's answer across engines: the fastest lossless way to decode a model measured on this machine."""

from __future__ import annotations

from collections import defaultdict

from draftlab.backends import engine_of_backend
from draftlab.deploy import Deployable
from draftlab.study.report import ALL, CellSummary, Drift, plain_label
from draftlab.study.cells import LLAMACPP_TARGET
from draftlab.contenders.methods import AR, HF, LLAMA, PLAIN, SPS, is_baseline, method_of
from draftlab.backends.base import ROUNDING
from draftlab.study.store import LEFT_OUT, ResultsStore


def engine_answer(summaries: list[CellSummary], drift: Drift | None = None) -> list[str]:
    """One sentence per model and temperature measured on more than one engine: the fastest lossless way to decode
    it on this machine (engine, and draft and K or plain decoding), beside each engine's plain decoding. `drift`:
    the study's; when the runner-up is within it, the sentence says so (another run may swap the two)."""
    groups: dict[tuple, list[CellSummary]] = defaultdict(list)
    for s in summaries:
        if s.dataset == ALL and s.tokens_per_s > 0 and not s.lossy and not s.rounding and s.complete:
            groups[(s.target.removeprefix(LLAMACPP_TARGET), s.temperature)].append(s)
    temperatures = defaultdict(set)
    for model, temperature in groups:
        temperatures[model].add(temperature)
    sentences = []
    for (model, temperature), cells in sorted(groups.items()):
        plain = {}
        for s in cells:
            if method_of(s.method).plain:
                plain[_engine(s)] = max(plain.get(_engine(s), 0.0), s.tokens_per_s)
        if len(plain) < 2:
            continue
        best, *rest = sorted(cells, key=lambda s: -s.tokens_per_s)
        at = f" at temperature {temperature:g}" if len(temperatures[model]) > 1 else ""
        engines = ", ".join(f"{engine} {speed:.1f}" for engine, speed in sorted(plain.items(), key=lambda e: -e[1]))
        sentences.append(f"Fastest measured for {model}{at} on this machine: {_what(best)} on {_engine(best)}, "
                         f"{best.tokens_per_s:.1f} tok/s end to end over {best.prompts} prompts (plain decoding, "
                         f"tok/s: {engines}){_runner_up(best, rest, drift)}.")
        sentences += _decode_winner(best, cells) + _phases(cells, model + at)
    return sentences


def _decode_winner(best: CellSummary, cells: list[CellSummary]) -> list[str]:
    """A sentence when another engine decodes faster after its prefill than the end-to-end winner: prefill (long
    prompts) decided the ranking."""
    timed = [s for s in cells if s.decode_tokens_per_s]
    if not timed:
        return []
    fastest = max(timed, key=lambda s: s.decode_tokens_per_s)
    if _engine(fastest) == _engine(best) or (best.decode_tokens_per_s or 0) >= fastest.decode_tokens_per_s:
        return []
    theirs = f"{fastest.prefill_s:.2f} s of prefill a prompt"
    ours = f"{best.prefill_s:.2f} s" if best.prefill_s is not None else "its prefill, not timed apart"
    return [f"{_what(fastest).capitalize()} on {_engine(fastest)} decodes fastest ({fastest.decode_tokens_per_s:.1f} "
            f"tok/s after its prefill); {_what(best)} on {_engine(best)} wins end to end because of prefill "
            f"({theirs} against {ours})."]


def _phases(cells: list[CellSummary], where: str) -> list[str]:
    """Prefill and decode apart, per engine's fastest plain decoding (where the engine times its prefill)."""
    plain: dict[str, CellSummary] = {}
    for s in cells:
        if method_of(s.method).plain and s.decode_tokens_per_s and (
                _engine(s) not in plain or s.tokens_per_s > plain[_engine(s)].tokens_per_s):
            plain[_engine(s)] = s
    if len(plain) < 2:
        return []
    parts = [f"{engine}: {s.prefill_s:.2f} s a prompt, then {s.decode_tokens_per_s:.1f} tok/s"
             for engine, s in sorted(plain.items(), key=lambda e: -e[1].decode_tokens_per_s)]
    return [f"Prefill and decode apart for {where} (plain decoding, mean over the prompts): {'; '.join(parts)}."]


def numerics_notes(envs: list[dict]) -> list[str]:
    """A sentence per target whose speculative cells ran on products that are not exact (every row of a block the
    row alone): their outputs equal plain decoding only up to rounding, whatever the count of identical outputs."""
    notes = {f"Numerics of {env.get('target') or 'the target'}: {env['numerics']}; its speculative outputs are "
             "lossless only up to rounding." for env in envs if ROUNDING in (env.get("numerics") or "")}
    return sorted(notes)


def left_out_notes(db) -> list[str]:
    """A line per engine the study's last sweep could not run (it died or hung in its preflight): the answer above
    was chosen without it."""
    import json

    store = ResultsStore(db, read_only=True)
    try:
        text = store.get_meta(LEFT_OUT)
    finally:
        store.close()
    try:
        lines = json.loads(text) if text else []
    except ValueError:
        return []
    return [f"Not run in this study, so not in the answer: {line}" for line in lines if isinstance(line, str)]


def _what(s: CellSummary) -> str:
    return "plain decoding" if method_of(s.method).plain else f"{s.drafter} at K={s.k} ({method_of(s.method)})"


def _runner_up(best: CellSummary, rest: list[CellSummary], drift: Drift | None) -> str:
    """A clause naming the runner-up when the lead is within the machine's drift during the study."""
    if not rest or drift is None or not drift.prompts:
        return ""
    second = rest[0]
    lead = best.tokens_per_s / second.tokens_per_s - 1
    if lead > drift.spread:
        return f"; it leads the runner-up by {lead:.0%}, beyond the machine's drift ({drift.spread:.0%})"
    return (f"; the runner-up, {_what(second)} on {_engine(second)} at {second.tokens_per_s:.1f} tok/s, is within the "
            f"machine's drift during the study ({lead:.0%} behind, drift {drift.spread:.0%}): another run may swap them")


def _engine(s: CellSummary) -> str:
    """The engine a cell ran on, in words."""
    method = method_of(s.method)
    if method.served:
        return "llama-server"
    if method.engine == LLAMA.engine:
        return "llama.cpp (llama-cpp-python)"
    if engine_of_backend(s.backend).runs_gguf or s.target.startswith(LLAMACPP_TARGET) or s.drafter.startswith("llama.cpp"):
        return "llama.cpp (draftlab)"
    if method.engine == HF.engine:
        return "HF transformers"
    return f"draftlab's torch backend ({s.drafter})" if method is PLAIN else "draftlab's torch backend"


def _identical_text(s: CellSummary) -> str:
    if s.identical is None:
        return "outputs sampled, so not compared token by token"
    if s.identical == s.prompts:
        return f"every output identical to plain decoding ({s.identical}/{s.prompts})"
    return f"only {s.identical}/{s.prompts} outputs identical to plain decoding"


def _judged_speedup(s: CellSummary) -> float:
    return s.host_speedup if s.host_speedup is not None else s.speedup


def recommend(summaries: list[CellSummary], drift: Drift) -> list[str]:
    """One sentence per target and temperature: which draft and K to use here, or plain decoding.

    Judged on each configuration's speedup over the fastest plain decoding measured on the host (the study's
    own, or another dtype or route timed beside it), over all the study's prompts (dataset 'all'); configurations
    whose greedy output differed from plain decoding are never recommended. A gain smaller than the
    baseline's drift on a noisy machine is said to be within the noise.
    """
    groups: dict[tuple, list[CellSummary]] = defaultdict(list)
    dropped: dict[tuple, list[CellSummary]] = defaultdict(list)
    plain_modes = {(s.target, s.temperature): f"{plain_label(s)}, {s.tokens_per_s:.1f} tok/s" for s in summaries
                   if s.dataset == ALL and method_of(s.method).plain and plain_label(s) == s.host_plain and s.complete}
    timed_others = {(s.target, s.temperature) for s in summaries
                    if s.dataset == ALL and method_of(s.method).plain and not is_baseline(s.method)}
    for s in summaries:
        if s.dataset == ALL and not method_of(s.method).plain and s.speedup > 0:
            (groups if s.complete else dropped)[(s.target, s.temperature)].append(s)
    for key, cells in dropped.items():
        groups.setdefault(key, [])
    temperatures = defaultdict(set)
    for target, temperature in groups:
        temperatures[target].add(temperature)
    sentences = []
    for (target, temperature), cells in sorted(groups.items()):
        where = target + (f" at temperature {temperature:g}" if len(temperatures[target]) > 1 else "")
        lossless = [s for s in cells if not s.lossy and not s.rounding]  # llama-server's own: serving.py
        lossy = sum(s.lossy for s in cells)
        warning = (f" ({lossy} configuration(s) produced output different from plain decoding and were not "
                   "considered: see the report)") if lossy else ""
        if not cells:
            sentences.append(_all_dropped(where, dropped[(target, temperature)], plain_modes.get((target, temperature))))
            continue
        if not lossless:
            sentences.append(f"Use plain decoding for {where}: no configuration measured is lossless (each differed "
                             f"from it, or is exact only up to rounding: see llama-server below){warning}.")
            continue
        best = max(lossless, key=_judged_speedup)
        gain = _judged_speedup(best)
        fastest = plain_modes.get((target, temperature), "") if best.host_plain not in ("", AR.name) else ""
        if fastest:
            versus = (f"{gain:.2f}x the fastest plain decoding measured here ({fastest}), {best.speedup:.2f}x plain "
                      "decoding in the study's own mode")
        elif (target, temperature) in timed_others:
            versus = (f"{gain:.2f}x plain decoding, the fastest measured here (other dtypes and routes were timed "
                      "slower)")
        else:
            versus = f"{gain:.2f}x plain decoding"
        measured = (f"{versus}, {best.speedup_min:.2f}-{best.speedup_max:.2f}x over {best.prompts} prompts, "
                    f"{best.tokens_per_s:.1f} tok/s")
        name = f"{best.drafter} at K={best.k} ({method_of(best.method)})"
        if gain <= 1.0:
            plain = f"plain decoding ({fastest})" if fastest else "plain decoding"
            sentences.append(f"Use {plain} for {where} on this machine: no configuration beat it "
                             f"(the best, {name}, ran at {measured}; {_identical_text(best)}){warning}.")
            continue
        noise = (f"; the gain is within the machine's drift during the study ({drift.spread:.0%}), so confirm it "
                 "on a quiet machine" if drift.noisy and gain - 1.0 <= drift.spread else "")
        sentences.append(f"Use {name} for {where} on this machine: {measured}; {_identical_text(best)}"
                         f"{noise}{warning}.")
    return sentences


def _all_dropped(where: str, cells: list[CellSummary], fastest: str | None) -> str:
    """The sentence for a target whose every configuration the race dropped before the study's last prompt."""
    best = max(cells, key=lambda s: s.speedup)
    plain = f"plain decoding ({fastest})" if fastest else "plain decoding"
    return (f"Use {plain} for {where} on this machine: every configuration trailed the fastest cell by more than "
            f"the margin and was dropped by the race (the closest, {best.drafter} at K={best.k} "
            f"({method_of(best.method)}), ran at {best.speedup:.2f}x the study's own plain decoding "
            f"over the {best.prompts} prompts it ran; {_identical_text(best)}; the report gives each cell's ratio "
            "to the leader).")


def fastest_lossless(summaries: list[CellSummary]) -> list[Deployable]:
    """Per target (greedy, over all the study's prompts): draftlab's fastest lossless speculative configuration
    measured on every prompt, or plain decoding ('none') where none beat the fastest plain decoding; for export."""
    eligible = [s for s in summaries if s.dataset == ALL and s.temperature == 0 and s.method == SPS.name and s.complete
                and not s.lossy and not s.rounding]
    best: dict[str, CellSummary] = {}
    for s in sorted(eligible, key=_judged_speedup):  # the fastest comes last and stays
        best[s.target] = s
    return [Deployable(target.removeprefix(LLAMACPP_TARGET), *((s.drafter, s.k) if _judged_speedup(s) > 1.0
                                                               else ("none", 0))) for target, s in sorted(best.items())]

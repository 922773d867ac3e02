"""The study's answer across engines: the fastest lossless way to decode a model measured on this machine."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from draftlab.deploy import Deployable
from draftlab.study.run.race import model_of
from draftlab.study.answer.report import ALL, CellSummary, Drift, engine_words, pace
from draftlab.study.answer.summary import interval_words
from draftlab.study.run.cells import LLAMACPP_TARGET, k_words
from draftlab.contenders.draftlab_serve import SERVE_DEPLOY, ServeConfig
from draftlab.decoding.kchoice import AUTO, rows_by_level
from draftlab.contenders.methods import AR, PLAIN, SERVE, SERVE_AR, SPS, VLLM, method_of
from draftlab.drafters.kinds import serves_batched
from draftlab.contenders.vllm import deploy_command as vllm_deploy_command
from draftlab.backends.base import ROUNDING


def engine_answer(summaries: list[CellSummary]) -> list[str]:
    """One sentence per model and temperature measured on more than one engine: each engine's prefill of a prompt
    and its plain decoding's rate after it (the answer itself, across engines, is `recommend`'s)."""
    groups: dict[tuple, list[CellSummary]] = defaultdict(list)
    for s in summaries:
        if s.dataset == ALL and s.tokens_per_s > 0 and not s.lossy and not s.rounding and s.complete:
            groups[(model_of(s.target), s.temperature)].append(s)
    temperatures = defaultdict(set)
    for model, temperature in groups:
        temperatures[model].add(temperature)
    return [line for (model, temperature), cells in sorted(groups.items()) for line in _phases(
        cells, model + (f" at temperature {temperature:g}" if len(temperatures[model]) > 1 else ""))]


def _phases(cells: list[CellSummary], where: str) -> list[str]:
    """Prefill and decode apart, per engine's fastest plain decoding (where the engine times its prefill)."""
    plain: dict[str, CellSummary] = {}
    for s in cells:
        if method_of(s.method).plain and s.decode_tokens_per_s and (
                engine_words(s) not in plain or s.tokens_per_s > plain[engine_words(s)].tokens_per_s):
            plain[engine_words(s)] = s
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


def left_out_notes(left_out: str | None) -> list[str]:
    """A line per engine the study's last sweep could not run (it died or hung in its preflight), from the store's
    JSON list (`StudyResults.left_out`): the answer above was chosen without it."""
    try:
        lines = json.loads(left_out) if left_out else []
    except ValueError:
        return []
    return [f"Not run in this study, so not in the answer: {line}" for line in lines if isinstance(line, str)]


def _identical_text(s: CellSummary) -> str:
    if s.identical is None:
        return "outputs sampled, so not compared token by token"
    if s.identical == s.prompts:
        return f"every output identical to plain decoding ({s.identical}/{s.prompts})"
    return f"only {s.identical}/{s.prompts} outputs identical to plain decoding"


RATES_DISAGREE = 0.05  # raw decode rates whose ratio is further than this from the paired one get a word on drift


def _judged_speedup(s: CellSummary) -> float:
    return s.host_speedup if s.host_speedup is not None else s.speedup


def _judged_interval(s: CellSummary) -> tuple[float, float]:
    """The judged speedup's paired interval (`draftlab.study.answer.host`)."""
    if s.host_speedup is not None:
        return s.host_low, s.host_high
    return s.speedup_low, s.speedup_high


def recommend(summaries: list[CellSummary], drift: Drift, output_tokens: int | None = None) -> list[str]:
    """One sentence per model and temperature, across its engines: which engine, draft and K to use here, or plain
    decoding.

    Draft and K are judged on decode speed, what speculation changes: each configuration's speedup over the fastest
    plain decoding of the model measured on the host (any engine, dtype or route), over all the study's prompts
    (dataset 'all'), with the 95% interval of its paired per-prompt ratios; a configuration whose greedy output
    differed from plain decoding is never recommended, nor one exact only up to rounding (llama-server's own:
    `serving.py`), nor one whose interval includes 1.0x (the answer is then plain decoding). The engine is judged by
    what the user waits for (`_sooner`): where another engine's pick answers a prompt of the study's (or
    `output_tokens`') length sooner end to end, its measured prefill included, by more than the noise, the answer is
    that engine's, and the sentence says which decodes faster. `drift`: the study's, said beside a noisy answer.
    """
    groups: dict[tuple, list[CellSummary]] = defaultdict(list)
    dropped: dict[tuple, list[CellSummary]] = defaultdict(list)
    for s in summaries:
        if s.dataset == ALL and s.speedup > 0 and not method_of(s.method).plain:
            (groups if s.complete else dropped)[(model_of(s.target), s.temperature)].append(s)
    plains = _reference_plain(summaries)
    for key in [*dropped, *plains]:
        groups.setdefault(key, [])
    temperatures = defaultdict(set)
    for model, temperature in groups:
        temperatures[model].add(temperature)
    sentences, lossless = [], _groups(summaries)
    for (model, temperature), cells in sorted(groups.items()):
        where = model + (f" at temperature {temperature:g}" if len(temperatures[model]) > 1 else "")
        plain = plains.get((model, temperature))
        sooner = _sooner(lossless.get((model, temperature), []), plain, drift, output_tokens)
        sentences.append(sooner.sentence(where) if sooner else
                         _sentence(where, cells, dropped[(model, temperature)], plain, drift, output_tokens))
    return sentences


def _reference_plain(summaries: list[CellSummary]) -> dict[tuple, CellSummary]:
    """Per (model, temperature): the plain decoding its cells are judged against (`draftlab.study.answer.host`: the one
    that decodes fastest, or llama-server's when none is surely faster), over all prompts."""
    return {(model_of(s.target), s.temperature): s for s in summaries if s.dataset == ALL and s.host_reference}


def _sentence(where: str, cells: list[CellSummary], dropped: list[CellSummary], plain: CellSummary | None,
              drift: Drift, output_tokens: int | None) -> str:
    """The one answer for a model: a configuration and its engine, or plain decoding on its fastest engine."""
    plain_words = f"plain decoding on {_mode(plain)}" if plain else "plain decoding"
    if not cells:
        return _all_dropped(where, dropped, plain_words) if dropped else f"Use {plain_words} for {where}."
    lossless = [s for s in cells if not s.lossy and not s.rounding]
    lossy = sum(s.lossy for s in cells)
    warning = (f" ({lossy} configuration(s) produced output different from plain decoding and were not "
               "considered: see the report)") if lossy else ""
    if not lossless and dropped:
        return _all_dropped(where, dropped, plain_words)[:-1] + f"{warning}."
    if not lossless:
        return (f"Use {plain_words} for {where} on this machine: no configuration measured is lossless (each "
                f"differed from it, or is exact only up to rounding: see llama-server below){warning}.")
    best = max(lossless, key=_judged_speedup)
    gain, (low, high) = _judged_speedup(best), _judged_interval(best)
    name = f"{best.drafter} at {k_words(best.k)} ({method_of(best.method)}) on {engine_words(best)}"
    measured = (f"{gain:.2f}x ({interval_words(low, high, best.prompts)}) {plain_words}, {_paces(best, plain, gain)}"
                f"{_end_to_end(best, plain, output_tokens)}")
    if gain <= 1.0 or low <= 1.0:
        why = "no configuration beat it" if gain <= 1.0 else "no configuration beat it surely (the interval of the best includes 1.0x)"
        noise = f"; the machine's drift during the study: {drift.spread:.0%}" if drift.noisy else ""
        return (f"Use {plain_words} for {where} on this machine: {why} (the best, {name}, ran at {measured}; "
                f"{_identical_text(best)}){noise}{warning}.")
    return f"Use {name} for {where} on this machine: {measured}; {_identical_text(best)}{warning}."


def _paces(best: CellSummary, plain: CellSummary | None, gain: float) -> str:
    """The two decode rates beside the paired ratio. Where the ratio went through the target's baseline (one target:
    each run against plain decoding re-timed beside it) and the raw rates disagree with it by more than
    `RATES_DISAGREE`, say why: they were timed minutes apart, and the machine's speed drifted in between."""
    against = pace(plain) if plain else pace(best) / gain
    rates = f"decoding {pace(best):.1f} tok/s against {against:.1f} over {best.prompts} prompts (paired per prompt"
    if plain is not None and plain.target == best.target and abs(pace(best) / against / gain - 1) > RATES_DISAGREE:
        rates += ("; these rates were timed minutes apart, and the ratio, through plain decoding re-timed beside "
                  "each run, cancels the machine's drift between them")
    return rates + ")"


def chosen(summaries: list[CellSummary], drift: Drift = Drift(0, 0.0), output_tokens: int | None = None
           ) -> dict[tuple, CellSummary]:
    """Per (model, temperature), what its Use line names: the configuration, or the plain decoding."""
    plains, groups = _reference_plain(summaries), _groups(summaries)
    picks = {key: _choice(cells, plains.get(key)) for key, cells in groups.items()}
    for key in picks:
        sooner = _sooner(groups[key], plains.get(key), drift, output_tokens)
        picks[key] = sooner.pick if sooner else picks[key]
    return {key: pick for key, pick in picks.items() if pick is not None}


def deploy_notes(summaries: list[CellSummary], drift: Drift = Drift(0, 0.0), output_tokens: int | None = None,
                 served_as: Callable[[CellSummary], tuple[str, int]] = lambda s: ("fp32", 1),
                 rows: dict[tuple[str, str], dict[int, int]] | None = None) -> list[str]:
    """A line per model whose answer (greedy) is not on llama-server: the command of a vLLM answer, exactly as the
    study served it (`served_as`: the dtype its records ran in and the study's most requests at once), the command of
    a draftlab serve answer (with K per load as `rows` found it, per GGUF and drafter, at the levels the study
    served), or why the Deploy line, llama-server's own best measured beside it, names another engine."""
    notes = []
    for (model, temperature), choice in sorted(chosen(summaries, drift, output_tokens).items()):
        method = method_of(choice.method)
        if temperature == 0 and method.engine == VLLM.engine:
            dtype, most_in_flight = served_as(choice)
            command = vllm_deploy_command(choice.target, dtype, choice.drafter, choice.k, most_in_flight)
            notes.append(f"Deploy {model} on vLLM, the answer, as the study served it (llama-server's best measured "
                         f"beside it follows): {command}")
        elif temperature == 0 and _serves(choice):
            notes.append(_serve_note(model, choice, served_as(choice)[1], (rows or {}).get(
                (choice.target.removeprefix(LLAMACPP_TARGET), choice.drafter))))
        elif temperature == 0 and not method.served:
            notes.append(f"The answer for {model} runs on {engine_words(choice)}, draftlab's own loop or library, "
                         "which has no server of its own to deploy: the Deploy line below is llama-server's best "
                         "measured beside it.")
    return notes


def _serves(choice: CellSummary) -> bool:
    """Whether `draftlab serve` runs the answer as it was measured: its own cells, or draftlab's exact llama.cpp
    route with a drafter the server runs."""
    method = method_of(choice.method)
    if method in (SERVE, SERVE_AR):
        return True
    return (method in (AR, SPS) and choice.target.startswith(LLAMACPP_TARGET) and not choice.rounding
            and serves_batched(choice.drafter))


def _serve_note(model: str, choice: CellSummary, most_in_flight: int, measured: dict[int, int] | None) -> str:
    """The answer's `draftlab serve` command: the same engine, drafter and K alone, exact at every load; above one
    request the K its served cells measured at each level (`measured`, by requests in flight: `drafter_rows`)."""
    plain = method_of(choice.method).plain
    alone = choice.k or AUTO  # K 0 of draftlab serve: `--k auto`
    k_per_load = "1:0" if plain else rows_by_level({**(measured or {}), 1: alone})
    config = ServeConfig(choice.target.removeprefix(LLAMACPP_TARGET), "none" if plain else choice.drafter,
                         k_per_load, slots=max(most_in_flight, 1), name="")
    return (f"Deploy {model} {SERVE_DEPLOY}, the answer, on the engine and drafter it was measured with (exact: each "
            f"request's tokens as alone, at every load; llama-server's best measured beside it follows): "
            f"{config.command()}")


SOONER_MARGIN = 0.10  # another engine's pick must answer this much sooner end to end (or by the drift, if larger)


@dataclass(frozen=True)
class Sooner:
    """The answer where the engine that answers a prompt soonest end to end is not the one whose pick decodes
    fastest: `pick`, that engine's own pick, against `faster`, the decode-judged pick on another engine."""

    pick: CellSummary
    faster: CellSummary
    tokens: int  # the output length both are judged at

    def seconds(self, s: CellSummary) -> float:
        """A prompt end to end: the engine's measured prefill, then `tokens` at its measured decode rate."""
        return s.prefill_s + self.tokens / pace(s)

    def sentence(self, where: str) -> str:
        pick, faster = self.pick, self.faster
        gain = "" if method_of(pick.method).plain else (
            f"; by decode {_judged_speedup(pick):.2f}x ({interval_words(*_judged_interval(pick), pick.prompts)}) the "
            "fastest plain decoding, paired per prompt")
        return (f"Use {_named(pick)} for {where} on this machine: end to end, {self.tokens}-token outputs, it answers a "
                f"prompt in {self.seconds(pick):.2f} s ({pick.prefill_s:.2f} s of prefill, then {pace(pick):.1f} tok/s) "
                f"against {self.seconds(faster):.2f} s for {_named(faster)}, which decodes faster ({pace(faster):.1f} "
                f"tok/s) but prefills in {faster.prefill_s:.2f} s; over {pick.prompts} prompts{gain}; "
                f"{_identical_text(pick)}.")


def _named(s: CellSummary) -> str:
    """A pick in words: its draft, K, method and engine, or plain decoding and its engine."""
    if method_of(s.method).plain:
        return f"plain decoding on {_mode(s)}"
    return f"{s.drafter} at {k_words(s.k)} ({method_of(s.method)}) on {engine_words(s)}"


def _sooner(cells: list[CellSummary], plain: CellSummary | None, drift: Drift, output_tokens: int | None
            ) -> Sooner | None:
    """For one (model, temperature), its complete lossless cells (`_groups`) and reference plain decoding: the
    engine whose pick (`_engine_picks`) answers a prompt of `output_tokens` (the study's own length when None)
    soonest end to end, where it is not the decode-judged pick's engine and answers sooner by more than
    `SOONER_MARGIN` or the study's typical drift; else None."""
    faster = _choice(cells, plain)
    if faster is None or faster.prefill_s is None or not faster.prompts:
        return None
    tokens = output_tokens or round(faster.new_tokens / faster.prompts)
    timed = [s for s in _engine_picks(cells).values() if s.prefill_s is not None]
    best = Sooner(min(timed, key=lambda s: s.prefill_s + tokens / pace(s)), faster, tokens)
    sooner = best.seconds(best.pick) * (1 + max(drift.typical, SOONER_MARGIN)) < best.seconds(faster)
    return best if sooner and engine_words(best.pick) != engine_words(faster) else None


def _engine_picks(cells: list[CellSummary]) -> dict[str, CellSummary]:
    """Per engine (in words), what it would run: its fastest decoding among its plain decodings and the speculation
    whose paired interval over its target's plain decoding lies above 1.0x."""
    picks: dict[str, CellSummary] = {}
    for s in sorted(cells, key=pace, reverse=True):
        if engine_words(s) not in picks and (method_of(s.method).plain or s.speedup_low > 1.0):
            picks[engine_words(s)] = s
    return picks


def _groups(summaries: list[CellSummary]) -> dict[tuple, list[CellSummary]]:
    """Complete lossless configurations of each (model, temperature), over all prompts."""
    groups: dict[tuple, list[CellSummary]] = defaultdict(list)
    for s in summaries:
        if s.dataset == ALL and s.speedup > 0 and s.complete and not s.lossy and not s.rounding:
            groups[(model_of(s.target), s.temperature)].append(s)
    return groups


def _choice(cells: list[CellSummary], plain: CellSummary | None) -> CellSummary | None:
    """What the answer names: the best configuration when its interval lies above 1.0x, else plain decoding."""
    candidates = [s for s in cells if not method_of(s.method).plain]
    if candidates:
        best = max(candidates, key=_judged_speedup)
        if _judged_interval(best)[0] > 1.0:
            return best
    return plain


def _mode(plain: CellSummary) -> str:
    """Plain decoding's engine and mode, in words: 'llama.cpp (draftlab)', 'draftlab's torch backend (bf16 ...)'."""
    words = engine_words(plain)
    return words + (f" ({plain.drafter})" if method_of(plain.method) is PLAIN and plain.drafter not in words else "")


def _end_to_end(best: CellSummary, plain: CellSummary | None, output_tokens: int | None) -> str:
    """End to end per prompt, prefill plus decode, for an output length: the configuration's and plain decoding's."""
    if plain is None or best.prefill_s is None or plain.prefill_s is None or not best.prompts:
        return ""
    tokens = output_tokens or round(best.new_tokens / best.prompts)
    ours = best.prefill_s + tokens / pace(best)
    theirs = plain.prefill_s + tokens / pace(plain)
    return (f"; end to end, {tokens}-token outputs: {ours:.2f} s a prompt ({best.prefill_s:.2f} s of prefill) "
            f"against {theirs:.2f} s")


def _all_dropped(where: str, cells: list[CellSummary], plain: str) -> str:
    """The sentence for a model whose every configuration the race dropped before the study's last prompt: the
    closest to the reference plain decoding, paired over the prompts it ran."""
    best = max(cells, key=_judged_speedup)
    low, high = _judged_interval(best)
    return (f"Use {plain} for {where} on this machine: every lossless configuration trailed the fastest cell by "
            f"more than the margin and was dropped by the race (the closest, {best.drafter} at {k_words(best.k)} "
            f"({method_of(best.method)}) on {engine_words(best)}, ran at {_judged_speedup(best):.2f}x "
            f"({interval_words(low, high, best.prompts)}) {plain}, paired, over the {best.prompts} prompts it ran; "
            f"{_identical_text(best)}; the report gives each cell's ratio to the leader).")


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

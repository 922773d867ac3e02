"""The loop itself: one timed call (`run_once`), a prompt through every contender (`measure_prompt`), a list of
prompts interleaved (`measure`), and the speedups defined once. See `draftlab.measure`."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Hashable, Mapping, Protocol, Sequence

from draftlab.engine import GenerationConfig, GenerationResult
from draftlab.decoding.metrics import GenerationStats
from draftlab.progress import track
from draftlab.decoding.sampling import SamplingConfig

DECODE = "decode"  # new tokens / (total - prefill) seconds
END_TO_END = "end-to-end"  # new tokens / total seconds
KINDS = (DECODE, END_TO_END)
WARMUP_TOKENS = 8  # an untimed warm-up run's new tokens


@dataclass(frozen=True)
class RunSettings:
    """What every contender generates: the same length, sampling and seed."""

    max_new_tokens: int = GenerationConfig.max_new_tokens
    temperature: float = SamplingConfig.temperature
    top_k: int = SamplingConfig.top_k
    top_p: float = SamplingConfig.top_p
    seed: int = GenerationConfig.seed

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt as token ids, with the id and category its records carry."""

    id: str
    category: str
    ids: list[int]


class Contender(Protocol):
    """What the loop times: one decode of token ids with the given settings.

    `times_prefill`: whether the returned statistics separate the prefill (draftlab's engine) or only the total is
    known (a peer library's `generate`). `forgetful`: the same contender for warm-up runs, teaching a drafter that
    learns across requests nothing about the prompts about to be timed. `prefill_key`: contenders with the same
    key share a prompt's prefill, one computation of the same kernels on the same file ('': none; each run
    prefills and nothing is timed apart); `prefill` computes it (the loop times it, once per key and prompt);
    `take_prefill` then makes the cache of every other contender of the key hold it, untimed (nothing where they
    share one cache; a copy where each holds its own, bitwise what its own prefill would hold); `reuses_prefill`:
    whether a run then starts from it (else the run prefills again, and the loop takes the timed prefill off it)."""

    times_prefill: bool
    reuses_prefill: bool
    prefill_key: str

    def run(self, prompt_ids: list[int], settings: RunSettings) -> GenerationResult: ...

    def prefill(self, prompt_ids: list[int]) -> None: ...

    def take_prefill(self, prompt_ids: list[int]) -> None: ...

    def forgetful(self) -> "Contender": ...


@dataclass(frozen=True)
class PrefillRecord:
    """One timed prefill of a prompt by the contenders of one `prefill_key`."""

    key: str
    prompt_id: str
    prompt_tokens: int
    seconds: float
    finished_at: float = 0.0


@dataclass
class RunRecord:
    """One contender on one prompt: output, statistics and times."""

    key: Hashable  # the contender's key in the loop
    prompt_id: str
    category: str
    token_ids: list[int]
    stats: GenerationStats  # stats.wall_s: the loop's timing of the whole call
    times_prefill: bool
    finished_at: float = 0.0  # time.time() when the run ended

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    def seconds(self, kind: str) -> float | None:
        """The run's seconds of that kind; None for DECODE when the engine does not time its prefill."""
        if kind == END_TO_END:
            return self.stats.wall_s
        return max(self.stats.wall_s - self.stats.prefill_s, 1e-9) if self.times_prefill else None

    def tokens_per_s(self, kind: str) -> float | None:
        seconds = self.seconds(kind)
        return self.new_tokens / seconds if seconds else None


def run_once(key: Hashable, contender: Contender, prompt: EncodedPrompt, settings: RunSettings,
             prefilled: float | None = None) -> RunRecord:
    """The loop's one timed call: decode `prompt` with `contender`. `prefilled`: the seconds of its key's prefill
    of the prompt, timed apart. The record is then one request's: `prefill_s` that prefill, and `wall_s` it plus
    the run's decode (a run that started from the prefill: its time less what it prefilled itself, a rollback or
    the prompt's last token; one that did not: its time, which prefilled again)."""
    start = time.perf_counter()
    result = contender.run(prompt.ids, settings)
    elapsed = time.perf_counter() - start
    stats = replace(result.stats, wall_s=elapsed, new_tokens=len(result.token_ids))
    times_prefill = contender.times_prefill
    if prefilled is not None:
        decode_s = elapsed - (min(stats.prefill_s, elapsed) if contender.reuses_prefill else min(prefilled, elapsed))
        stats, times_prefill = replace(stats, prefill_s=prefilled, wall_s=prefilled + decode_s), True
    return RunRecord(key, prompt.id, prompt.category, list(result.token_ids), stats, times_prefill, time.time())


def prefill_once(contenders: Sequence[Contender], prompt: EncodedPrompt) -> dict[str, PrefillRecord]:
    """The prompt prefilled once per prefill key of the contenders, each timed, by key; every other contender of a
    key then takes that prefill (untimed). A contender whose prefill fails, or that cannot take one, is left to its
    run, which prefills itself and reports the error as its own."""
    records: dict[str, PrefillRecord] = {}
    for contender in contenders:
        if not contender.prefill_key:
            continue
        if contender.prefill_key in records:
            _take(contender, prompt)
            continue
        start = time.perf_counter()
        try:
            contender.prefill(prompt.ids)
        except Exception:  # noqa: BLE001 (the run says what it was)
            continue
        records[contender.prefill_key] = PrefillRecord(contender.prefill_key, prompt.id, len(prompt.ids),
                                                       time.perf_counter() - start, time.time())
    return records


def _take(contender: Contender, prompt: EncodedPrompt) -> None:
    """The contender's cache made to hold its key's prefill of the prompt; on failure its run prefills itself."""
    try:
        contender.take_prefill(prompt.ids)
    except Exception:  # noqa: BLE001 (the run says what it was)
        pass


def pilot(contenders: Mapping[Hashable, Contender], prompt: EncodedPrompt, settings: Mapping[Hashable, RunSettings]
          ) -> tuple[dict[str, PrefillRecord], dict[Hashable, RunRecord]]:
    """A host's timings before a study plans (`draftlab.study.run.budget`): the prompt prefilled once per key, then a
    short decode of each contender's forgetful view from it (`settings`: each one's), as the loop times them. A
    contender that fails here is left out (its timed runs report why)."""
    prefills, records = prefill_once(list(contenders.values()), prompt), {}
    for key, contender in contenders.items():
        prefill = prefills.get(contender.prefill_key)
        try:
            records[key] = run_once(key, contender.forgetful(), prompt, settings[key], prefill and prefill.seconds)
        except Exception:  # noqa: BLE001 (a peer's or engine's refusal: its timed runs say it)
            continue
    return prefills, records


def warm_up(contenders: Mapping[Hashable, Contender], prompt: EncodedPrompt, settings: RunSettings,
            tolerate: Callable[[Hashable, Exception], bool] = lambda key, exc: False) -> None:
    """Untimed short runs of every contender's forgetful view: first calls pay one-off costs. A contender whose
    error `tolerate` accepts is left to its timed runs (which report it)."""
    short = replace(settings, max_new_tokens=min(WARMUP_TOKENS, settings.max_new_tokens))
    for key, contender in contenders.items():
        try:
            contender.forgetful().run(prompt.ids, short)
        except Exception as exc:
            if not tolerate(key, exc):
                raise


@dataclass
class Measurement:
    """Every run of a `measure` call, by contender key in prompt order, and the baseline's re-timings."""

    records: dict[Hashable, list[RunRecord]] = field(default_factory=dict)
    checks: list[RunRecord] = field(default_factory=list)

    def speedup(self, key: Hashable, over: Hashable, kind: str) -> float | None:
        """`key`'s speedup over `over` on the prompts both ran."""
        runs, paces = paired(self.records.get(key, []), self.records.get(over, []), kind)
        return speedup(runs, paces)

    def per_prompt(self, key: Hashable, over: Hashable, kind: str) -> list[float]:
        """`key`'s speedup over `over` on each prompt both ran."""
        runs, paces = paired(self.records.get(key, []), self.records.get(over, []), kind)
        return [tokens / seconds / pace for (tokens, seconds), pace in zip(runs, paces)]

    def tokens_per_s(self, key: Hashable, kind: str) -> float | None:
        """`key`'s tokens per second over all its runs."""
        runs = self.records.get(key, [])
        seconds = [r.seconds(kind) for r in runs]
        if not runs or None in seconds or not sum(seconds):
            return None
        return sum(r.new_tokens for r in runs) / sum(seconds)

    def drift(self) -> float:
        """The largest relative spread of the baseline's tokens/s over one prompt's timings (0 without checks)."""
        return drift([*self.records.get(self.checks[0].key, []), *self.checks] if self.checks else [])


def paired(runs: Sequence[RunRecord], baselines: Sequence[RunRecord], kind: str
           ) -> tuple[list[tuple[int, float]], list[float]]:
    """(tokens, seconds) of each run and the baseline's pace (tokens/s) on the same prompt, for prompts both ran
    and timed in that kind."""
    pace = {b.prompt_id: b.tokens_per_s(kind) for b in baselines}
    pairs = [((r.new_tokens, r.seconds(kind)), pace.get(r.prompt_id)) for r in runs]
    kept = [(run, p) for run, p in pairs if run[1] and p]
    return [run for run, _ in kept], [p for _, p in kept]


def speedup(runs: Sequence[tuple[int, float]], paces: Sequence[float]) -> float | None:
    """The one speedup: seconds the baseline needs for the runs' tokens (each prompt at its baseline pace, tokens/s)
    over the runs' seconds. `runs`: (new tokens, seconds) per prompt, in either kind, the paces in the same."""
    own = sum(seconds for _, seconds in runs)
    if not runs or own <= 0:
        return None
    return sum(tokens / pace for (tokens, _), pace in zip(runs, paces)) / own


def drift(baseline_runs: Sequence[RunRecord]) -> float:
    """Largest (fastest - slowest) / median end-to-end tokens/s among the baseline's runs of one prompt."""
    by_prompt: dict[str, list[float]] = {}
    for run in baseline_runs:
        by_prompt.setdefault(run.prompt_id, []).append(run.tokens_per_s(END_TO_END) or 0.0)
    spreads = [(max(s) - min(s)) / statistics.median(s) for s in by_prompt.values() if len(s) > 1 and min(s) > 0]
    return max(spreads, default=0.0)


@dataclass(frozen=True)
class Rechecks:
    """Re-time the baseline (`contender`, whose own runs have `key`) on the same prompt after every `every` other
    contenders and after the last."""

    key: Hashable
    contender: Contender
    every: int


class Listener:
    """What `measure_prompt` tells its caller as it goes. Each method here does nothing: a caller overrides what it
    needs (the sweep stores every record and skip as it comes)."""

    def started(self, key: Hashable) -> None:
        """A run (a contender's, or the baseline's re-check) is about to start."""

    def prefilled(self, record: PrefillRecord) -> None:
        """The prompt was prefilled once for one prefill key."""

    def recorded(self, record: RunRecord) -> None:
        """A contender's run ended."""

    def rechecked(self, record: RunRecord) -> None:
        """The baseline was re-timed on the prompt."""

    def failed(self, key: Hashable, exc: Exception) -> bool:
        """A contender's run raised: True when the caller took it as a skip (the loop goes on), False to raise it."""
        return False


def measure_prompt(contenders: Mapping[Hashable, Contender], prompt: EncodedPrompt, settings: RunSettings,
                   rechecks: Rechecks | None = None, listener: Listener = Listener()) -> list[RunRecord]:
    """Every contender on one prompt, in the given order, after the prompt's prefill once per prefill key; the
    `listener` hears of each prefill, each run's start and end, each re-check, and each error. A contender whose
    error the listener takes as a skip is passed over; any other error propagates. With `rechecks`, the baseline is
    re-timed on the prompt as `Rechecks` says: after every `every` runs of the others that ended, and after the last
    if any ran since."""
    records, since = [], 0
    keys = list(contenders)
    prefills = prefill_once([*([rechecks.contender] if rechecks else []), *contenders.values()], prompt)
    for prefill in prefills.values():
        listener.prefilled(prefill)
    seconds = {key: prefill.seconds for key, prefill in prefills.items()}
    for index, key in enumerate(keys):
        listener.started(key)
        try:
            record = run_once(key, contenders[key], prompt, settings, seconds.get(contenders[key].prefill_key))
        except Exception as exc:
            if not listener.failed(key, exc):
                raise
            continue
        records.append(record)
        listener.recorded(record)
        if rechecks is None or not rechecks.every:
            continue
        since = 0 if key == rechecks.key else since + 1
        if since and (since >= rechecks.every or index + 1 == len(keys)):
            listener.started(rechecks.key)
            listener.rechecked(run_once(rechecks.key, rechecks.contender, prompt, settings,
                                        seconds.get(rechecks.contender.prefill_key)))
            since = 0
    return records


def measure(contenders: Mapping[Hashable, Contender], prompts: Sequence[EncodedPrompt], settings: RunSettings, *,
            warmup: int = 1, rechecks: Rechecks | None = None, progress: str = "") -> Measurement:
    """Decode every prompt with every contender, interleaved per prompt (the order rotated from prompt to prompt),
    after `warmup` untimed runs on the first prompts; `progress`: the bar's label ('' for none)."""
    out = Measurement({key: [] for key in contenders})
    for prompt in prompts[:warmup]:
        warm_up(contenders, prompt, settings)
    keys = list(contenders)
    for i, prompt in enumerate(track(prompts, progress, unit="prompt", disable=not progress)):
        order = keys[i % len(keys):] + keys[: i % len(keys)] if keys else keys
        for record in measure_prompt({k: contenders[k] for k in order}, prompt, settings, rechecks, _Checks(out.checks)):
            out.records[record.key].append(record)
    return out


@dataclass(frozen=True)
class _Checks(Listener):
    """Collects the baseline's re-checks into `checks`."""

    checks: list[RunRecord]

    def rechecked(self, record: RunRecord) -> None:
        self.checks.append(record)

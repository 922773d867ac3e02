"""The study's answer for a server: per workload and concurrency, the fastest configuration and the fastest lossless
one, up to which concurrency speculation pays, and the llama-server command line to deploy.

Computed from the records alone. Under load a record's prompt went out with the prompts of its window
(`draftlab.measure.InFlight`): a cell's throughput is its windows' new tokens over their wall time (aggregate
tokens/s) and its latency the mean of its requests'. Alone (concurrency 1) every cell of the study takes part,
draftlab's own included; above 1 only llama-server's. llama-server's own speculation is lossless only up to
rounding (its kernels round a block's rows apart from single rows), so it is never the fastest *lossless* answer,
however many of its outputs were identical: they are counted and said.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from draftlab.deploy import Deployable, per_batch_size
from draftlab.contenders.llama_server import ServerConfig
from draftlab.contenders.server_configs import spec_config
from draftlab.study.run.cells import LLAMACPP_TARGET, k_words
from draftlab.contenders.methods import PLAIN, SERVE, SERVER, SERVER_AR, is_baseline, method_of
from draftlab.perf.baselines import interval
from draftlab.study.answer.report import ALL
from draftlab.study.answer.summary import interval_words
from draftlab.models import gguf_path
from draftlab.study.answer.plots import Labels, finish, plt, slug


@dataclass(frozen=True)
class LoadSummary:
    """One configuration at one concurrency over a workload's prompts."""

    target: str
    dataset: str
    temperature: float
    concurrency: int
    method: str
    drafter: str
    k: int
    prompts: int
    tokens_per_s: float  # aggregate: every request's new tokens over the windows' wall time
    latency_s: float  # mean seconds per request
    identical: int | None  # outputs equal to plain decoding on the same engine (greedy only)
    drafted: int
    accepted: int
    rates: tuple[tuple[str, float], ...] = ()  # (prompt id, its window's aggregate tokens/s), for paired intervals
    as_reference: int | None = None  # greedy outputs equal to draftlab's plain decoding of the target (None: unknown)

    @property
    def exact(self) -> bool:
        """Lossless: plain decoding, or speculation on exact products whose every output matched."""
        method = method_of(self.method)
        return method.plain or (method.exact and self.identical == self.prompts)

    @property
    def name(self) -> str:
        """The configuration in words."""
        method = method_of(self.method)
        if method.plain:
            engine = self.drafter if method is PLAIN else method.engine
            return f"plain decoding ({engine})"
        length = f" {k_words(self.k)}" if self.k or self.method == SERVE.name else " (default length)"
        where = method.engine if method.served else self.method.upper()
        return f"{where} {self.drafter}{length}"


def load_summaries(rows: list[dict]) -> list[LoadSummary]:
    """One summary per (target, dataset and 'all', temperature, concurrency, configuration)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        config = (r["target"], r["temperature"], r.get("concurrency") or 1, r["method"], r["drafter"], r["k"])
        groups[(r["dataset"], *config)].append(r)
        groups[(ALL, *config)].append(r)
    reference = {(r["target"], r["temperature"], r.get("prompt_id")): r.get("output_sha") for r in rows
                 if is_baseline(r["method"]) and (r.get("concurrency") or 1) == 1 and r.get("output_sha")}
    out = []
    for (dataset, target, temperature, concurrency, method, drafter, k), group in groups.items():
        wall = sum(r["wall_s"] for r in group)
        tokens = sum(r.get("window_tokens") or r["new_tokens"] for r in group)
        known = [r["identical"] for r in group if r["identical"] is not None]
        out.append(LoadSummary(target, dataset, temperature, concurrency, method, drafter, k, len(group),
                               tokens / wall if wall else 0.0,
                               statistics.mean(r.get("latency_s") or r["wall_s"] for r in group),
                               sum(known) if known else None, sum(r["drafted"] for r in group),
                               sum(r["accepted"] for r in group), tuple(_rates(group)),
                               _as_reference(group, reference)))
    return out


def _as_reference(group: list[dict], reference: dict[tuple, str]) -> int | None:
    """How many greedy outputs of the group equal draftlab's plain decoding of the same target and prompt (None:
    sampled, or no such output recorded)."""
    pairs = [(r.get("output_sha"), reference.get((r["target"], r["temperature"], r.get("prompt_id")))) for r in group
             if r["temperature"] == 0]
    known = [ours == theirs for ours, theirs in pairs if theirs is not None]
    return sum(known) if known else None


def _rates(group: list[dict]) -> list[tuple[str, float]]:
    """Each prompt's aggregate tokens/s: its window's new tokens over the window's wall time."""
    return [(r.get("prompt_id", ""), (r.get("window_tokens") or r["new_tokens"]) / r["wall_s"]) for r in group
            if r["wall_s"]]


def own_plain_gain(s: LoadSummary, summaries: list[LoadSummary]) -> tuple[float, float, float, int] | None:
    """A served configuration over its own server's plain decoding at the same level and workload: (speedup of
    aggregate tokens/s, its paired 95% interval, the prompts paired); None for a plain one, or without it."""
    method = method_of(s.method)
    if method.plain:
        return None
    plain = next((p for p in summaries if p.method == method.reference and p.tokens_per_s
                  and (p.target, p.dataset, p.temperature, p.concurrency)
                  == (s.target, s.dataset, s.temperature, s.concurrency)), None)
    if plain is None:
        return None
    theirs = dict(plain.rates)
    ratios = [rate / theirs[prompt] for prompt, rate in s.rates if theirs.get(prompt)]
    point = s.tokens_per_s / plain.tokens_per_s
    return (point, *interval(point, ratios), len(ratios))


@dataclass(frozen=True)
class LevelAnswer:
    """At one concurrency on one workload: the fastest configuration, the fastest lossless one, and llama-server's
    plain decoding and speculative configurations."""

    target: str
    dataset: str
    temperature: float
    concurrency: int
    fastest: LoadSummary
    lossless: LoadSummary | None
    server_plain: LoadSummary | None
    server_types: tuple[LoadSummary, ...]  # llama-server's speculative configurations, fastest first

    def gain(self, config: LoadSummary | None) -> float | None:
        """A server configuration's aggregate tokens/s over the server's plain decoding at this level."""
        same = [s for s in self.server_types if config is not None and (s.drafter, s.k) == (config.drafter, config.k)]
        if not same or self.server_plain is None or not self.server_plain.tokens_per_s:
            return None
        return same[0].tokens_per_s / self.server_plain.tokens_per_s

    @property
    def clean(self) -> LoadSummary | None:
        """The server's fastest speculation whose every greedy output equalled its plain decoding (None: none)."""
        return next((s for s in self.server_types if s.identical is None or s.identical == s.prompts), None)


def level_answers(summaries: list[LoadSummary]) -> list[LevelAnswer]:
    """Per (target, workload, temperature, concurrency) where llama-server ran: the fastest configurations among
    those that ran every prompt of the level; the servers' among the servers that ran the most prompts (the race may
    drop a server's cells after a few prompts: the Deploy line still answers from what they measured)."""
    levels: dict[tuple, list[LoadSummary]] = defaultdict(list)
    for s in summaries:
        levels[(s.target, s.dataset, s.temperature, s.concurrency)].append(s)
    out = []
    for key, cells in sorted(levels.items()):
        servers = [s for s in cells if method_of(s.method).served and s.tokens_per_s > 0]
        if not servers:
            continue
        most = max(s.prompts for s in cells)
        cells = [s for s in cells if s.prompts == most and s.tokens_per_s > 0] or servers
        llama = [s for s in servers if s.method in (SERVER_AR.name, SERVER.name)]
        most_served = max((s.prompts for s in llama), default=0)
        plain = [s for s in llama if s.method == SERVER_AR.name and s.prompts == most_served]
        types = sorted((s for s in llama if s.method == SERVER.name and s.prompts == most_served),
                       key=lambda s: -s.tokens_per_s)
        out.append(LevelAnswer(*key, max(cells, key=lambda s: s.tokens_per_s),
                               max((s for s in cells if s.exact), key=lambda s: s.tokens_per_s, default=None),
                               plain[0] if plain else None, tuple(types)))
    return out


def deploy_choice(answers: list[LevelAnswer], margin: float = 0.0) -> LoadSummary | None:
    """The server configuration to deploy for one workload: at concurrency 1, the server's fastest speculation whose
    every output equalled its plain decoding, where it beats that plain decoding by more than `margin` (the
    machine's typical drift during the study: a smaller gain is noise); else the plain decoding."""
    alone = [a for a in answers if a.concurrency == 1]
    if not alone or alone[0].server_plain is None:
        return None
    clean = alone[0].clean
    return clean if (alone[0].gain(clean) or 0.0) > 1.0 + margin else alone[0].server_plain


def choice_pays(answers: list[LevelAnswer], choice: LoadSummary, margin: float = 0.0) -> list[tuple[int, bool]]:
    """(concurrency, whether the chosen configuration beats the server's plain decoding there by more than
    `margin`), in rising concurrency: the rows of its `deploy.per_batch_size` table."""
    return [(a.concurrency, choice.method == SERVER.name and (a.gain(choice) or 0.0) > 1.0 + margin)
            for a in sorted(answers, key=lambda a: a.concurrency)]


def deploy_config(answers: list[LevelAnswer], model: Path, margin: float = 0.0) -> ServerConfig | None:
    """The command's configuration: the chosen configuration with as many slots as the highest level measured up to
    which it keeps paying (1 for plain decoding)."""
    choice = deploy_choice(answers, margin)
    if choice is None:
        return None
    table = per_batch_size(choice_pays(answers, choice, margin), choice.k or -1)
    slots = table[0][1] if table[0][2] else 1
    return spec_config(model, choice.drafter, choice.k, slots)


def server_sentences(answers: list[LevelAnswer], model_file, margin: float = 0.0) -> list[str]:
    """Per target: what llama-server does at each concurrency on each workload, the fastest lossless answer beside
    it; then, over all the study's prompts, the vLLM-shaped table and the command to deploy. `model_file`: a target
    name -> its GGUF (for the command); `margin`: the gain over plain decoding that counts (the machine's drift)."""
    by_target: dict[tuple, list[LevelAnswer]] = defaultdict(list)
    for answer in answers:
        by_target[(answer.target, answer.temperature)].append(answer)
    sentences = []
    for (target, _), levels in sorted(by_target.items()):
        model = target.removeprefix(LLAMACPP_TARGET)
        workloads = sorted({a.dataset for a in levels} - {ALL})
        for answer in sorted(levels, key=lambda a: (a.dataset, a.concurrency)):
            if answer.dataset != ALL and (answer.concurrency > 1 or answer.server_plain is not None):
                sentences.append(_level_sentence(model, answer, workloads))  # one request: llama-server's own
        overall = [a for a in levels if a.dataset == ALL] or levels
        choice = deploy_choice(overall, margin)
        if choice is None:
            continue
        if len(overall) > 1 and choice.method == SERVER.name:
            sentences.append(f"On llama-server, {choice.name} per concurrency in vLLM's "
                             f"num_speculative_tokens_per_batch_size shape (K -1: the type's default length): "
                             f"{per_batch_size(choice_pays(overall, choice, margin), choice.k or -1)}.")
        rounds = " (its own speculation: every output identical to its plain decoding here" + (
            ", on draftlab's exact kernels)" if SERVER.exact else
            ", but exact only up to rounding, so the Use line does not rank it)")
        why = (rounds if choice.method == SERVER.name else
               " (plain decoding: no speculative type kept every output identical to it and beat it alone by more than "
               f"{margin:.0%})")
        sentences.append(f"Deploy {model} on llama-server{why} with: "
                         f"{deploy_config(overall, model_file(target), margin).command()}")
    return sentences


def server_deployables(rows: list[dict], margin: float = 0.0) -> list[Deployable]:
    """Per target where llama-server ran, over all the study's prompts: the configuration to deploy and, when the
    study measured more than one concurrency, its K per batch size (`draftlab.deploy`)."""
    answers = level_answers(load_summaries(rows))
    out = []
    for target in sorted({a.target for a in answers}):
        overall = [a for a in answers if a.target == target and a.dataset == ALL]
        choice = deploy_choice(overall, margin)
        if choice is None:
            continue
        table = per_batch_size(choice_pays(overall, choice, margin), choice.k or -1) if len(overall) > 1 and choice.method == SERVER.name else []
        drafter = choice.drafter if choice.method == SERVER.name else "none"
        out.append(Deployable(target.removeprefix(LLAMACPP_TARGET), drafter, choice.k, tuple(map(tuple, table))))
    return out


def _level_sentence(model: str, answer: LevelAnswer, workloads: list[str]) -> str:
    """One level in words. Under load: the fastest configuration and the fastest lossless one; one request at a time,
    llama-server's own comparison alone (the Use line answers for one request, across every engine)."""
    fastest, lossless = answer.fastest, answer.lossless
    on = f" on {answer.dataset}" if len(workloads) > 1 else ""
    if answer.concurrency == 1:
        return _server_gains(f"On llama-server for {model}{on}, one request at a time", answer) + "."
    where = f"{model}{on} with {answer.concurrency} request(s) in flight"
    text = f"Fastest for {where}: {fastest.name}, {fastest.tokens_per_s:.1f} tok/s"
    if not fastest.exact:
        same = (f"{fastest.identical}/{fastest.prompts} outputs identical to its plain decoding"
                if fastest.identical is not None else "outputs sampled")
        text += f" (lossless only up to rounding: {same})"
    if lossless is not None and lossless is not fastest:
        text += f"; fastest lossless: {lossless.name}, {lossless.tokens_per_s:.1f} tok/s"
    return _server_gains(text, answer) + "."


def _server_gains(text: str, answer: LevelAnswer) -> str:
    """`text`, then llama-server's best speculation (and its best with every output identical) over its plain
    decoding at this level."""
    best, clean = (answer.server_types[0] if answer.server_types else None), answer.clean
    found = []
    for label, config in (("best speculation", best),
                          ("best speculation with every output identical", clean if clean is not best else None)):
        if answer.gain(config) is not None:
            found.append(f"llama-server's {label}, {config.name}, is {answer.gain(config):.2f}x its plain decoding "
                         f"({answer.server_plain.tokens_per_s:.1f} tok/s; {answer.server_plain.latency_s:.2f} s per "
                         f"request against {config.latency_s:.2f} s)")
    if not found and answer.concurrency == 1:
        found.append("its plain decoding ran alone")
    return text + (": " if answer.concurrency == 1 else "; ") + "; ".join(found) if found else text


def server_answer(summaries: list[LoadSummary], margin: float = 0.0) -> list[str]:
    """The sentences for a study's summaries per concurrency (none when no llama-server cell ran); `margin`: the gain
    over plain decoding that counts (the study's typical drift)."""
    return server_sentences(level_answers(summaries), lambda target: gguf_path(target.removeprefix(LLAMACPP_TARGET)),
                            margin)


def draw_load(summaries: list[LoadSummary], out: Path) -> list[tuple[str, str]]:
    """Per target with more than one concurrency: aggregate tokens/s vs concurrency, one line per llama-server
    configuration (dashed: plain decoding); returns (file name, title) pairs."""
    lines: dict[str, dict[tuple, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for s in summaries:
        if s.dataset == ALL and method_of(s.method).served:
            lines[s.target][(s.name, s.method)][s.concurrency] = s.tokens_per_s
    figures = []
    for target, configs in sorted(lines.items()):
        if len({c for points in configs.values() for c in points}) < 2:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for (name, method), points in sorted(configs.items()):
            levels = sorted(points)
            ax.plot(levels, [points[c] for c in levels], marker="o", label=name,
                    linestyle="--" if method == SERVER_AR.name else "-")
        file, title = f"load_{slug(target)}.png", f"llama-server under load ({target})"
        if finish(fig, ax, out / file, Labels("requests in flight", "aggregate tokens/s", title), integer_x=True):
            figures.append((file, title))
    return figures


def format_load(summaries: list[LoadSummary]) -> str:
    """The served configurations (llama-server's, vLLM's) per concurrency as a table (workload 'all'), each
    speculative one with its speedup over its own server's plain decoding at that level and the paired interval;
    '' when none ran."""
    rows = sorted((s for s in summaries if s.dataset == ALL and method_of(s.method).served),
                  key=lambda s: (s.target, s.temperature, s.concurrency, not method_of(s.method).plain,
                                 -s.tokens_per_s))
    if not rows:
        return ""
    lines = [f"{'target':<28}{'c':>3}  {'configuration':<44}{'tok/s':>8}{'latency s':>11}{'identical':>11}"
             f"{'accepted':>10}{'= draftlab':>12}  its plain decoding: x (95%)"]
    for s in rows:
        same = f"{s.identical}/{s.prompts}" if s.identical is not None else "-"
        rate = f"{s.accepted / s.drafted:.0%}" if s.drafted else "-"
        draftlab = f"{s.as_reference}/{s.prompts}" if s.as_reference is not None else "-"
        lines.append(f"{s.target:<28}{s.concurrency:>3}  {s.name:<44}{s.tokens_per_s:>8.1f}{s.latency_s:>11.2f}"
                     f"{same:>11}{rate:>10}{draftlab:>12}  {_gain_words(own_plain_gain(s, summaries))}")
    return "\n".join(lines)


def _gain_words(gain: tuple[float, float, float, int] | None) -> str:
    """'1.30x (1.12-1.50)', with the interval's words for too few prompts; '-' without a gain."""
    if gain is None:
        return "-"
    point, low, high, prompts = gain
    return f"{point:.2f}x ({interval_words(low, high, prompts)})"

"""The study's race (cells that trail the leader stop being measured) and cells skipped with a one-line reason."""

from __future__ import annotations

import json

import pytest

from draftlab.study.answer.recommend import engine_answer, recommend
from draftlab.study.answer.sections import skipped_cells
from draftlab.study.run.race import PromptSet, RaceRule, dropped_cells, race_order, readmitted
from draftlab.study.answer.report import baseline_drift, load_checks, load_study, summarize
from draftlab.study.run.store import Cell, ResultsStore
from draftlab.study.run.sweep import SweepConfig, run_sweep
from tests.conftest import tiny_model_dir


def cell(method: str, drafter: str = "none", k: int = 0, target: str = "m") -> Cell:
    return Cell(target, drafter, k, method, "d", 0.0, 16)


LENGTHS = {"a": 40, "b": 60}


def rows_of(c: Cell, tokens_per_s: float, prompts=("a", "b"), identical: int | None = 1) -> list[dict]:
    return [{"cell": c.key, "prompt_id": p, "new_tokens": 16, "wall_s": 16 / tokens_per_s, "prefill_s": 0.0,
             "identical": identical} for p in prompts]


def same(lengths: dict[str, int]) -> PromptSet:
    return PromptSet({"m": lengths, "llamacpp:m": lengths})


def test_cells_that_trail_the_leader_beyond_the_margin_are_dropped():
    ar, fast, close, slow = cell("ar"), cell("sps", "ngram", 1), cell("sps", "ngram", 2), cell("sps", "ngram", 3)
    other_engine = cell("plain", "llama.cpp repack", target="llamacpp:m")
    rows = [*rows_of(ar, 10), *rows_of(fast, 20), *rows_of(close, 18), *rows_of(slow, 12), *rows_of(other_engine, 22)]
    cells = [ar, fast, close, slow, other_engine]
    dropped = dropped_cells(cells, rows, RaceRule(after=2), same(LENGTHS))
    # the leader is plain decoding on the other engine; 0.91x stays within 15%, 0.82x and 0.55x do not; ar stays
    assert set(dropped) == {close.key, slow.key}
    assert "0.55x" in dropped[slow.key] and "llamacpp:m plain" in dropped[slow.key]


def test_the_margin_widens_with_the_drift_and_nothing_drops_before_enough_prompts():
    ar, lead, behind, best = cell("ar"), cell("plain", "bf16"), cell("sps", "ngram", 1), cell("sps", "ngram", 2)
    rows = [*rows_of(ar, 10), *rows_of(lead, 20), *rows_of(behind, 14), *rows_of(best, 15)]  # 0.70x, 0.75x
    cells = [ar, lead, behind, best]
    assert set(dropped_cells(cells, rows, RaceRule(after=2, margin=0.15), same(LENGTHS))) == {behind.key}
    assert dropped_cells(cells, rows, RaceRule(after=2, margin=0.15), same(LENGTHS), drift=0.5) == {}
    assert dropped_cells(cells, rows, RaceRule(after=3), same(LENGTHS)) == {}
    assert dropped_cells(cells, rows, RaceRule(after=0), same(LENGTHS)) == {}


def test_the_fastest_speculative_cell_runs_every_prompt_even_behind_plain_decoding():
    """Plain decoding leads by far: the best speculation (the challenger) still runs the whole set, so the answer
    states its speedup with a paired interval over every prompt; the rest are dropped."""
    ar, lead = cell("ar"), cell("plain", "bf16")
    challenger, behind, lossy = cell("sps", "ngram", 1), cell("sps", "ngram", 2), cell("sps", "ngram", 3)
    rows = [*rows_of(ar, 10), *rows_of(lead, 30), *rows_of(challenger, 15), *rows_of(behind, 12),
            *rows_of(lossy, 25, identical=0)]
    dropped = dropped_cells([ar, lead, challenger, behind, lossy], rows, RaceRule(after=2), same(LENGTHS))
    assert challenger.key not in dropped and behind.key in dropped and "0.40x" in dropped[behind.key]


def test_a_cell_is_judged_on_its_best_rate_not_on_its_mean():
    ar, lead, uneven = cell("ar"), cell("plain", "bf16"), cell("sps", "ngram", 1)
    lengths = {"a": 40, "b": 60, "c": 50, "d": 45}
    # 0.6x the leader on average, but one prompt at the leader's speed: the prompts left may all be like it
    rows = [*rows_of(ar, 10, "ab"), *rows_of(lead, 20, "ab"), *rows_of(uneven, 20, "a"), *rows_of(uneven, 8, "b")]
    assert uneven.key not in dropped_cells([ar, lead, uneven], rows, RaceRule(after=2), same(lengths))


def test_a_cell_dropped_earlier_never_leads_the_cells_still_racing():
    ar, dropped, racing = cell("ar"), cell("sps", "ngram", 3), cell("sps", "ngram", 1)
    lengths = {"a": 40, "b": 60, "c": 50}
    # the dropped cell ran the two fast prompts only; the racing ones also ran a slow third prompt
    rows = [*rows_of(ar, 10, ("a", "b", "c")), *rows_of(dropped, 30), *rows_of(racing, 20, ("a", "b", "c"))]
    assert racing.key not in dropped_cells([ar, dropped, racing], rows, RaceRule(after=2), same(lengths))  # it leads


def test_a_lossy_cell_never_leads_and_a_peers_plain_decoding_stays_while_its_lookup_runs():
    ar, lossy, plain = cell("ar"), cell("sps", "ngram", 1), cell("llama")
    lookup, slow = cell("lcp", "ngram", 1), cell("sps", "ngram", 2)
    rows = [*rows_of(ar, 20), *rows_of(lossy, 100, identical=0), *rows_of(plain, 12), *rows_of(lookup, 19),
            *rows_of(slow, 10)]
    dropped = dropped_cells([ar, lossy, plain, lookup, slow], rows, RaceRule(after=2), same(LENGTHS))
    assert lossy.key not in dropped or "leader (m ar" in dropped[lossy.key]  # the leader is the lossless ar
    assert plain.key not in dropped and lookup.key not in dropped and slow.key in dropped


def timed_rows(c: Cell, lengths: dict[str, int], prefill_s_per_token: float, decode_tokens_per_s: float,
               tokens: int = 64) -> list[dict]:
    """Records of a cell with a prefill line and a decode rate (as the seeds' time model writes them)."""
    return [{"cell": c.key, "prompt_id": p, "new_tokens": tokens, "identical": 1,
             "prefill_s": 0.01 + prefill_s_per_token * n, "wall_s": 0.01 + prefill_s_per_token * n
             + tokens / decode_tokens_per_s} for p, n in lengths.items()]


def test_with_each_engines_prefill_timed_apart_the_race_ranks_decode_what_speculation_changes():
    """llama-server decodes faster but prefills 3x slower: the race ranks decode (each engine's prefill of a
    prompt is timed apart and common to its cells), so the torch backend's slower-decoding cell is dropped, and the
    answer states each engine's prefill and decode apart."""
    short = {f"s{i}": 20 + 20 * i for i in range(4)}
    long = {f"l{i}": 1800 + 100 * i for i in range(4)}
    server, ar = cell("server-ar", target="llamacpp:m"), cell("ar")
    spec, challenger = cell("sps", "ngram", 3), cell("sps", "ngram", 1)
    first = [*timed_rows(server, short, 0.003, 60), *timed_rows(ar, short, 0.001, 30),
             *timed_rows(spec, short, 0.001, 45), *timed_rows(challenger, short, 0.001, 50)]
    raced = dropped_cells([server, ar, spec, challenger], first, RaceRule(after=4), same({**short, **long}))
    assert spec.key in raced and "leader (llamacpp:m server-ar" in raced[spec.key] and challenger.key not in raced
    everything = [*timed_rows(server, {**short, **long}, 0.003, 60), *timed_rows(ar, {**short, **long}, 0.001, 30),
                  *timed_rows(spec, {**short, **long}, 0.001, 45)]
    for r in everything:
        r.update(target=r["cell"].split("|")[0], method=r["cell"].split("|")[1], drafter=r["cell"].split("|")[2],
                 k=int(r["cell"].split("|")[3][2:]), dataset="d", temperature=0.0, steps=r["new_tokens"],
                 drafted=0, accepted=0, draft_s=0.0, target_s=0.0, overhead_s=0.0, accepted_per_step=[],
                 drafted_per_step=[], backend="llamacpp" if r["cell"].startswith("llamacpp") else "fast")
    (phases,) = engine_answer(summarize(everything))
    assert phases.startswith("Prefill and decode apart for m") and "llama-server:" in phases


def test_the_race_sees_the_longest_and_shortest_prompts_first_and_every_category_early():
    lengths = {"p0": 50, "p1": 10, "p2": 900, "p3": 60, "p4": 70, "p5": 40}
    categories = {"p0": "code", "p1": "chat", "p2": "summary", "p3": "math", "p4": "code", "p5": "chat"}
    order = race_order(list(lengths), lengths, categories)
    assert order[:2] == ["p2", "p1"] and set(order[:4]) == {"p2", "p1", "p0", "p3"} and sorted(order) == sorted(lengths)


def test_a_dropped_cell_comes_back_when_the_leader_changes():
    ar, lead, spec = cell("ar"), cell("plain", "bf16"), cell("sps", "ngram", 1)
    challenger = cell("sps", "ngram", 2)  # the best speculation: it runs every prompt
    lengths = {"a": 40, "b": 60, "c": 50}
    early = [*rows_of(ar, 10, "ab"), *rows_of(lead, 30, "ab"), *rows_of(spec, 12, "ab"), *rows_of(challenger, 13)]
    cells = [ar, lead, spec, challenger]
    before = dropped_cells(cells, early, RaceRule(after=2), same(lengths))
    assert spec.key in before and challenger.key not in before
    later = [*early, *rows_of(ar, 10, "c"), *[{**r, "wall_s": 16 / 2} for r in rows_of(lead, 2, "c")],
             *rows_of(challenger, 13, "c")]
    after = dropped_cells(cells, later, RaceRule(after=2), same(lengths))
    assert readmitted(set(before), after) == {spec.key}


def write_prompts(path, lengths: list[int]) -> None:
    path.write_text("".join(json.dumps({"prompt": " ".join(f"w{(i * 7 + j) % 60}" for j in range(n)),
                                        "category": "code", "id": f"q{i}"}) + "\n" for i, n in enumerate(lengths)))


@pytest.mark.slow
def test_a_real_sweep_races_stores_its_decisions_and_resumes_with_nothing_to_do(tmp_path):
    model = tiny_model_dir(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, [12] * 4)
    config = SweepConfig(targets=(str(model),), drafters=("ngram", "layers:0-1"), ks=(1, 6), methods=("sps",),
                         datasets=(str(prompts),), limit=4, max_new_tokens=24, warmup=0, baseline_every=0,
                         host_baselines=False, race_after=1)
    db = tmp_path / "s.sqlite"
    store = ResultsStore(db)
    run_sweep(config, store, progress=False)
    skips, done = store.skips(), store.done()
    assert run_sweep(config, store, progress=False) == 0  # decisions are stored: a resume has nothing to do
    store.close()
    rows, params, _ = load_study(db)
    # the layer draft's weights counted (the target's embeddings and head it reads too); n-gram has none
    assert params[f"{model}::layers:0-1"] > 0 and f"{model}::ngram" not in params
    cells = {r["cell"] for r in rows}
    assert all((c, f"q{i}") in done for c in cells for i in range(4))  # every cell ends every prompt
    assert all(s["reason"].startswith("dropped by the race after") for s in skips)
    assert {r["cell"] for r in rows if r["method"] == "ar"} and all(
        sum(1 for r in rows if r["cell"] == c) == 4 for c in cells if "|ar|" in c)
    summaries = summarize(rows, load_checks(db))
    complete = {(s.method, s.drafter, s.k) for s in summaries if s.complete and s.dataset == "all"}
    dropped = {(s.method, s.drafter, s.k) for s in summaries if not s.complete and s.dataset == "all"}
    assert len(dropped) == len({s["cell"] for s in skips})
    assert ("ar", "none", 0) in complete and not complete & dropped
    sentences = recommend(summaries, baseline_drift(rows, load_checks(db)))
    assert len(skipped_cells(skips)) == len(dropped)  # one line per cell the race dropped
    assert all("dropped by the race" not in s or "Use plain decoding" in s for s in sentences)


@pytest.mark.slow
def test_a_prompt_longer_than_the_context_is_skipped_with_one_line_and_the_sweep_goes_on(tmp_path, capsys):
    model = tiny_model_dir(tmp_path / "tiny")  # its context holds 512 positions
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, [12, 700, 12])
    config = SweepConfig(targets=(str(model),), drafters=("ngram",), ks=(2,), methods=("sps", "asg"),
                         datasets=(str(prompts),), limit=3, max_new_tokens=8, warmup=0, baseline_every=0,
                         host_baselines=False)
    store = ResultsStore(tmp_path / "s.sqlite")
    run_sweep(config, store, progress=False)
    skips = store.skips()
    measured = {(r["method"], r["prompt_id"]) for r in store.rows()}
    store.close()
    assert {s["prompt_id"] for s in skips} == {"q1"}
    assert len(skips) == 4 and all("\n" not in s["reason"] and s["reason"] for s in skips)  # ar, sps, hf, asg
    assert {m for m, p in measured if p in ("q0", "q2")} == {"ar", "sps", "hf", "asg"}
    out = capsys.readouterr().out
    assert out.count("skipped q1") == 4 and "Traceback" not in out


def test_the_latency_plot_and_the_optimal_table_compare_every_line_on_the_same_prompts(tmp_path):
    """A cell the race dropped after two prompts beside cells that ran four: the figure is drawn on the two prompts
    every cell ran (its data, written beside it, says so), and the table ranks only cells that ran every prompt."""
    from draftlab.study.answer.page import build_report
    from draftlab.study.answer.tables import optimal_table
    from draftlab.study.run.store import Record

    store = ResultsStore(tmp_path / "s.sqlite")
    run = store.start_run({})
    ar, kept, dropped = cell("ar"), cell("sps", "ngram", 1), cell("sps", "ngram", 2)
    for c, prompts, seconds in ((ar, "abcd", 1.0), (kept, "abcd", 0.8), (dropped, "ab", 0.5)):
        for p in prompts:
            store.add(Record(c, p, "code", 16, 8 if c.k else 16, 8 * c.k, 8, [1] * 8 if c.k else [],
                             [c.k] * 8 if c.k else [], prefill_s=0.1, wall_s=seconds), run)
    store.close()
    build_report(tmp_path / "s.sqlite", tmp_path / "report")
    with (tmp_path / "report" / "latency_vs_k_m_t0.csv").open() as handle:
        points = list(__import__("csv").DictReader(handle))
    assert {p["line"] for p in points} == {"SPS ngram", "autoregressive"} and len(points) == 3
    assert {p["prompts"] for p in points} == {"2"}  # every line on the two prompts all cells ran
    rows, params, _ = load_study(tmp_path / "s.sqlite")
    ranked = optimal_table(summarize(rows), params)
    assert all(r.k != 2 for r in ranked) and any(r.method == "sps" and r.k == 1 for r in ranked)

"""The study's race (cells that trail the leader stop being measured) and cells skipped with a one-line reason."""

from __future__ import annotations

import json

from draftlab.study.answer import recommend
from draftlab.study.pruning import RaceRule, dropped_cells, format_skips
from draftlab.study.report import baseline_drift, load_checks, load_study, summarize
from draftlab.study.store import Cell, ResultsStore
from draftlab.study.sweep import SweepConfig, run_sweep
from tests.conftest import tiny_model_dir


def cell(method: str, drafter: str = "none", k: int = 0, target: str = "m") -> Cell:
    return Cell(target, drafter, k, method, "d", 0.0, 16)


def rows_of(c: Cell, tokens_per_s: float, prompts=("a", "b"), identical: int | None = 1) -> list[dict]:
    return [{"cell": c.key, "prompt_id": p, "new_tokens": 16, "wall_s": 16 / tokens_per_s, "identical": identical}
            for p in prompts]


def test_cells_that_trail_the_leader_beyond_the_margin_are_dropped():
    ar, fast, close, slow = cell("ar"), cell("sps", "ngram", 1), cell("sps", "ngram", 2), cell("sps", "ngram", 3)
    other_engine = cell("plain", "llama.cpp repack", target="llamacpp:m")
    rows = [*rows_of(ar, 10), *rows_of(fast, 20), *rows_of(close, 18), *rows_of(slow, 12), *rows_of(other_engine, 22)]
    cells = [ar, fast, close, slow, other_engine]
    dropped = dropped_cells(cells, rows, RaceRule(after=2))
    # the leader is plain decoding on the other engine; 0.91x stays within 15%, 0.82x and 0.55x do not; ar stays
    assert set(dropped) == {close.key, slow.key}
    assert "0.55x" in dropped[slow.key] and "llamacpp:m plain" in dropped[slow.key]


def test_the_margin_widens_with_the_drift_and_nothing_drops_before_enough_prompts():
    ar, lead, behind = cell("ar"), cell("plain", "bf16"), cell("sps", "ngram", 1)
    rows = [*rows_of(ar, 10), *rows_of(lead, 20), *rows_of(behind, 16)]  # 0.80x the leader
    assert set(dropped_cells([ar, lead, behind], rows, RaceRule(after=2, margin=0.15))) == {behind.key}
    assert dropped_cells([ar, lead, behind], rows, RaceRule(after=2, margin=0.15), drift=0.3) == {}
    assert dropped_cells([ar, lead, behind], rows, RaceRule(after=3)) == {}
    assert dropped_cells([ar, lead, behind], rows, RaceRule(after=0)) == {}


def test_a_cell_dropped_earlier_never_leads_the_cells_still_racing():
    ar, dropped, racing = cell("ar"), cell("sps", "ngram", 3), cell("sps", "ngram", 1)
    # the dropped cell ran the two fast prompts only; the racing ones also ran a slow third prompt
    rows = [*rows_of(ar, 10, ("a", "b", "c")), *rows_of(dropped, 30), *rows_of(racing, 20, ("a", "b", "c"))]
    assert racing.key not in dropped_cells([ar, dropped, racing], rows, RaceRule(after=2))  # it leads


def test_a_lossy_cell_never_leads_and_a_peers_plain_decoding_stays_while_its_lookup_runs():
    ar, lossy, plain = cell("ar"), cell("sps", "ngram", 1), cell("llama")
    lookup, slow = cell("lcp", "ngram", 1), cell("sps", "ngram", 2)
    rows = [*rows_of(ar, 20), *rows_of(lossy, 100, identical=0), *rows_of(plain, 12), *rows_of(lookup, 19),
            *rows_of(slow, 10)]
    dropped = dropped_cells([ar, lossy, plain, lookup, slow], rows, RaceRule(after=2))
    assert lossy.key not in dropped or "leader (m ar" in dropped[lossy.key]  # the leader is the lossless ar
    assert plain.key not in dropped and lookup.key not in dropped and slow.key in dropped


def write_prompts(path, lengths: list[int]) -> None:
    path.write_text("".join(json.dumps({"prompt": " ".join(f"w{(i * 7 + j) % 60}" for j in range(n)),
                                        "category": "code", "id": f"q{i}"}) + "\n" for i, n in enumerate(lengths)))


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
    rows, _, _ = load_study(db)
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
    if dropped:
        assert format_skips(skips).count("\n") == len(dropped)
        assert all("dropped by the race" not in s or "Use plain decoding" in s for s in sentences)


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

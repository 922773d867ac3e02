"""The Deploy line as a `draftlab serve` command where draftlab's server beats llama-server alone, with K per load."""

from __future__ import annotations

from draftlab.study.answer.report import ALL
from draftlab.study.answer.serve_deploy import serve_sentences
from draftlab.study.answer.serving import LoadSummary

TARGET = "llamacpp:smollm2-135m@Q4_0_PURE"


def cell(method: str, concurrency: int, tokens_per_s: float, drafter: str = "none", k: int = 0,
         as_reference: int | None = 8) -> LoadSummary:
    return LoadSummary(TARGET, ALL, 0.0, concurrency, method, drafter, k, 8, tokens_per_s, 1.0, None, 0, 0,
                       as_reference=as_reference)


def row(method: str, rate: float, prompt: str, drafter: str = "none", k: int = 0) -> dict:
    """One stored record of a prompt on the llama.cpp target (what `summarize` reads)."""
    return {"target": TARGET, "dataset": "d", "temperature": 0.0, "prompt_id": prompt, "method": method,
            "drafter": drafter, "k": k, "new_tokens": 100, "wall_s": 100 / rate, "steps": 50, "drafted": 60,
            "accepted": 50, "prefill_s": 0.0, "draft_s": 0.0, "target_s": 0.0, "overhead_s": 0.0,
            "accepted_per_step": [], "drafted_per_step": [], "identical": 1, "finished_at": 0.0,
            "backend": "llamacpp"}


def test_draftlab_serve_wins_alone_and_k_follows_the_load():
    cells = [cell("server-ar", 1, 150), cell("server", 1, 170, "ngram-simple", 16), cell("server-ar", 4, 300),
             cell("serve-ar", 1, 140), cell("serve", 1, 210, "suffix", 6), cell("serve", 1, 190, "suffix", 3),
             cell("serve-ar", 2, 220), cell("serve", 2, 260, "suffix", 3), cell("serve", 2, 250, "suffix", 6),
             cell("serve-ar", 4, 330), cell("serve", 4, 320, "suffix", 6)]
    [line] = serve_sentences(cells, margin=0.05)
    assert line.startswith("Deploy smollm2-135m@Q4_0_PURE on draftlab serve (exact")
    assert "1.24x" in line and "--drafter suffix --k-per-load 1:6,2:3,3-64:0 --max-in-flight 4" in line
    from draftlab.study.answer.serve_deploy import serve_configs

    [unsure] = serve_configs(cells, margin=0.6).values()  # no level pays by more than the drift: plain decoding
    assert (unsure.drafter, unsure.k_per_load) == ("none", "1:0")


def test_k_auto_measured_under_load_deploys_as_k_auto_for_the_levels_measured():
    """`--k auto` raced alone and at 4 in flight: deployed with `--k auto --max-in-flight 4` where it kept within the
    drift of the fastest fixed K and plain decoding at each level; else K per load from the fixed K."""
    raced = [cell("server-ar", 1, 150), cell("serve-ar", 1, 140), cell("serve", 1, 230, "suffix", 3),
             cell("serve", 1, 220, "suffix", 0), cell("serve-ar", 4, 330), cell("serve", 4, 335, "suffix", 0)]
    [line] = serve_sentences(raced, margin=0.05)
    assert "--drafter suffix --k auto --max-in-flight 4" in line and "suffix K=3" in line
    slower = [*raced[:-1], cell("serve", 4, 290, "suffix", 0)]  # auto under load trails plain decoding there
    [line] = serve_sentences(slower, margin=0.05)
    assert "--drafter suffix --k-per-load 1:3,2-64:0 --max-in-flight 4" in line
    best_auto = [*raced[:2], cell("serve", 1, 240, "suffix", 0), raced[-2], raced[-1]]
    [line] = serve_sentences(best_auto, margin=0.05)
    assert "suffix K auto" in line and "--k auto --max-in-flight 4" in line


def test_a_deploy_line_of_plain_decoding_cites_and_needs_plain_decodings_own_figure():
    """Where no K beat draftlab serve's plain decoding by more than the drift, the line deploys plain decoding: it
    is printed only where that plain decoding itself beat llama-server by more than the drift, and cites its figure."""
    unsure = [cell("server-ar", 1, 70), cell("serve-ar", 1, 80), cell("serve", 1, 95, "suffix", 2)]
    assert serve_sentences(unsure, margin=0.33) == []  # suffix 1.36x llama-server, but plain is what it would deploy
    faster = [cell("server-ar", 1, 50), cell("serve-ar", 1, 80), cell("serve", 1, 95, "suffix", 2)]
    [line] = serve_sentences(faster, margin=0.33)
    assert "plain" in line.split(" with: ")[0] and "80.0 tok/s alone, 1.60x" in line
    assert "--drafter none --k-per-load 1:0" in line


def test_no_line_where_llama_server_is_as_fast_or_an_output_differed():
    close = [cell("server-ar", 1, 150), cell("serve-ar", 1, 150), cell("serve", 1, 155, "suffix", 6)]
    assert serve_sentences(close, margin=0.05) == []
    differed = [cell("server-ar", 1, 150), cell("serve-ar", 1, 140), cell("serve", 1, 250, "suffix", 6, as_reference=7)]
    assert serve_sentences(differed, margin=0.05) == []  # its only win left plain decoding once: not exact here
    alone = [cell("serve-ar", 1, 140), cell("serve", 1, 250, "suffix", 6)]
    assert serve_sentences(alone) == []  # no llama-server measured: nothing to beat


def test_llama_servers_dropped_by_the_race_still_give_a_deploy_line():
    from pathlib import Path

    from draftlab.study.answer.serving import level_answers, server_sentences

    cells = [cell("ar", 1, 140), cell("sps", 1, 160, "ngram", 2),  # draftlab's cells ran all 8 prompts
             *(LoadSummary(TARGET, ALL, 0.0, 1, method, drafter, k, 5, rate, 1.0, 5 if k else None, 0, 0)
               for method, drafter, k, rate in (("server-ar", "none", 0, 150), ("server", "ngram-simple", 16, 180)))]
    lines = server_sentences(level_answers(cells), lambda target: Path("model.gguf"), margin=0.05)
    assert any(line.startswith("Deploy smollm2-135m@Q4_0_PURE on llama-server") and "--spec-type ngram-simple" in line
               for line in lines), lines


def test_serve_from_a_study_takes_its_fastest_exact_llama_cpp_answer_or_its_raced_server(tmp_path):
    from draftlab.study.answer.results import StudyResults
    from draftlab.study.answer.serve_deploy import serve_answer

    def row(method: str, rate: float, prompt: str, drafter: str = "none", k: int = 0, concurrency: int = 1) -> dict:
        return {"target": TARGET, "dataset": "d", "temperature": 0.0, "prompt_id": prompt, "method": method,
                "drafter": drafter, "k": k, "new_tokens": 100, "wall_s": 100 / rate, "steps": 50, "drafted": 60,
                "accepted": 50, "prefill_s": 0.0, "draft_s": 0.0, "target_s": 0.0, "overhead_s": 0.0,
                "accepted_per_step": [], "drafted_per_step": [], "identical": 1, "finished_at": 0.0,
                "backend": "llamacpp", "concurrency": concurrency, "output_sha": prompt}

    prompts = [f"p{i}" for i in range(6)]
    rows = [r for i, p in enumerate(prompts) for r in (row("ar", 10.0, p), row("sps", 14.0 + i % 2, p, "suffix", 6))]
    results = StudyResults(tmp_path / "study.sqlite", rows, {}, [], [], [], None)
    answer = serve_answer(results)
    assert (answer.target, answer.drafter, answer.k_per_load) == ("smollm2-135m@Q4_0_PURE", "suffix", "1:6")
    rows += [r for p in prompts for r in (row("serve-ar", 12.0, p), row("serve", 15.0, p, "ngram", 3),
                                          row("serve-ar", 20.0, p, concurrency=2),
                                          row("serve", 19.0, p, "ngram", 3, concurrency=2))]
    raced = serve_answer(StudyResults(tmp_path / "study.sqlite", rows, {}, [], [], [], None))
    assert (raced.drafter, raced.k_per_load, raced.slots) == ("ngram", "1:3,2-64:0", 2)


def test_an_answer_on_draftlabs_llama_cpp_route_deploys_on_draftlab_serve():
    from draftlab.study.answer.recommend import deploy_notes
    from draftlab.study.answer.report import Drift, summarize

    rows = [r for i in range(6) for r in (row("ar", 10.0, f"p{i}"), row("sps", 15.0 + i % 2, f"p{i}", "suffix", 2))]
    [line] = deploy_notes(summarize(rows), Drift(6, 0.02))
    assert line.startswith("Deploy smollm2-135m on draftlab serve, the answer")
    assert "draftlab serve --target smollm2-135m@Q4_0_PURE --drafter suffix --k-per-load 1:2" in line
    lookups = [r for i in range(6) for r in (row("ar", 10.0, f"p{i}"), row("sps", 15.0, f"p{i}", "ngram:1-3", 2))]
    [lookup] = deploy_notes(summarize(lookups), Drift(6, 0.02))
    assert "--drafter ngram:1-3 --k-per-load 1:2" in lookup


def test_an_answer_of_draftlabs_loop_takes_its_k_under_load_from_the_drafters_served_cells():
    """The Use line's answer (suffix K=2 on draftlab's llama.cpp route) deployed on draftlab serve: alone its K; at
    4 in flight what the study measured of that drafter served there: `--k auto` where it ran within the drift of
    plain decoding (`2-64:auto`), a fixed K where it beat plain decoding, plain decoding where both trailed it."""
    from draftlab.study.answer.recommend import deploy_notes
    from draftlab.study.answer.report import Drift, summarize
    from draftlab.decoding.kchoice import rows_by_level
    from draftlab.study.answer.serve_deploy import drafter_rows

    answer = summarize([r for i in range(6)
                        for r in (row("ar", 10.0, f"p{i}"), row("sps", 15.0, f"p{i}", "suffix", 2))])
    alone = [cell("serve-ar", 1, 140), cell("serve", 1, 190, "suffix", 2), cell("serve-ar", 4, 330)]
    for at_four, rows in (([cell("serve", 4, 335, "suffix", 0)], "1:2,2-64:auto"),
                          ([cell("serve", 4, 300, "suffix", 2), cell("serve", 4, 380, "suffix", 3)], "1:2,2-64:3"),
                          ([cell("serve", 4, 250, "suffix", 0), cell("serve", 4, 280, "suffix", 3)], "1:2,2-64:0")):
        measured = drafter_rows(alone + at_four, margin=0.05)
        [line] = deploy_notes(answer, Drift(6, 0.02), rows=measured, served_as=lambda s: ("gguf", 4))
        assert f"--drafter suffix --k-per-load {rows} --max-in-flight 4" in line, line
    auto = drafter_rows([alone[0], cell("serve", 1, 200, "suffix", 0), alone[2], cell("serve", 4, 335, "suffix", 0)],
                        margin=0.05)[("smollm2-135m@Q4_0_PURE", "suffix")]
    assert rows_by_level(auto) == "auto" and rows_by_level({1: 3, 4: 0, 8: 0}) == "1:3,2-64:0"

"""The report's table of drafts that learn across requests, from a real sweep on a tiny model."""

from __future__ import annotations

import json

import pytest

from tests.required import ARCTIC, unless

from draftlab.drafters import suffix
from draftlab.study.answer.learning import format_learning, learning_rows
from draftlab.study.answer.page import build_report
from draftlab.study.answer.report import load_checks, load_study, summarize
from draftlab.study.run.store import ResultsStore
from draftlab.study.run.sweep import SweepConfig, run_sweep
from tests.conftest import tiny_model_dir

pytestmark = unless(suffix.available(), ARCTIC, suffix.INSTALL_HINT)


@pytest.mark.slow
def test_suffix_cells_show_cold_and_warm_beside_ngram_and_plain(tmp_path):
    model = tiny_model_dir(tmp_path / "tiny")
    prompts = tmp_path / "stream.jsonl"  # a stream of requests of two templates: later answers repeat earlier ones
    prompts.write_text("".join(
        json.dumps({"prompt": " ".join(f"w{(i % 2) * 9 + j}" for j in range(6)), "category": "stream", "id": f"r{i}"})
        + "\n" for i in range(6)))
    config = SweepConfig(targets=(str(model),), drafters=("suffix", "suffix:responses=0", "ngram"), ks=(8,),
                         methods=("sps",), datasets=(str(prompts),), limit=6, max_new_tokens=24, warmup=1,
                         baseline_every=0, dtype="fp32", host_baselines=False)
    db = tmp_path / "study.sqlite"
    run_sweep(config, ResultsStore(db), progress=False)
    rows, _, _ = load_study(db)
    table = learning_rows(summarize(rows, load_checks(db)), rows)
    by_label = {r.label: r for r in table}
    assert set(by_label) == {"suffix warm", "suffix cold", "best n-gram", "plain"}
    assert by_label["suffix warm"].later_tokens_per_step > by_label["suffix cold"].later_tokens_per_step
    held = sorted(r["cache_held"] for r in rows if r["drafter"] == "suffix")
    assert held == list(range(6))  # the warm-up run taught the cell nothing
    assert "suffix warm" in format_learning(table)
    assert "Drafts that learn across requests" in build_report(db, tmp_path / "report").read_text()

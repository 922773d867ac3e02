"""Ratios that hold on a noisy machine: each cell against the baseline measured closest in time, drift flagged."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace

import pytest

from draftlab.perf.baselines import baseline_timings
from draftlab.study.answer.page import build_report
from draftlab.study.answer.report import baseline_drift, load_checks, load_study, summarize
from draftlab.study.run.store import SCHEMA_VERSION, Cell, Record, ResultsStore
from draftlab.study.run.sweep import SweepConfig, run_sweep
from tests.conftest import tiny_model_dir


def row(method: str, tokens_per_s: float, at: float | None, prompt: str = "p1", k: int = 0) -> dict:
    return {"target": "t", "dataset": "d", "temperature": 0.0, "prompt_id": prompt, "method": method,
            "drafter": "none" if method == "ar" else "ngram", "k": k, "new_tokens": 100, "wall_s": 100 / tokens_per_s,
            "steps": 50, "drafted": 60, "accepted": 50, "prefill_s": 0.0, "draft_s": 0.0, "target_s": 0.0,
            "overhead_s": 0.0, "accepted_per_step": [], "drafted_per_step": [], "identical": 1, "finished_at": at}


def sps(summaries, k):
    return next(s for s in summaries if s.method == "sps" and s.k == k and s.dataset == "d")


def test_each_cell_is_compared_with_the_baseline_at_its_time():
    # The machine halves its speed: the baseline ran at 10 tok/s first, 5 tok/s at its re-check 100 s later.
    rows = [row("ar", 10.0, 0.0), row("sps", 12.0, 10.0, k=1), row("sps", 6.0, 95.0, k=2), row("sps", 6.0, 120.0, k=3)]
    checks = [row("ar", 5.0, 100.0)]
    summaries = summarize(rows, checks)
    assert abs(sps(summaries, 1).speedup - 12.0 / 9.5) < 1e-9  # the baseline's pace at 10 s: 9.5 tok/s
    assert abs(sps(summaries, 2).speedup - 6.0 / 5.25) < 1e-9  # at 95 s: 5.25 tok/s, not 0.6x
    assert abs(sps(summaries, 3).speedup - 1.2) < 1e-9  # after the last re-check: against it (5 tok/s)
    without = summarize(rows)  # the old way: one baseline for the whole study
    assert abs(sps(without, 2).speedup - 0.6) < 1e-9
    drift = baseline_drift(rows, checks)
    assert drift.noisy and drift.prompts == 1 and "NOISY" in drift.describe()


def test_a_quiet_machine_is_not_flagged_and_old_records_fall_back_to_the_ar_record():
    rows = [row("ar", 10.0, 0.0), row("sps", 12.0, 10.0, k=1)]
    assert not baseline_drift(rows, [row("ar", 10.3, 50.0)]).noisy
    legacy = [row("ar", 10.0, None), row("sps", 12.0, None, k=1)]
    assert abs(sps(summarize(legacy, [row("ar", 5.0, 100.0)]), 1).speedup - 1.2) < 1e-9
    assert "not measured" in baseline_drift(legacy, []).describe()


def test_the_median_over_prompts_tells_one_disturbance_from_a_noisy_machine():
    # Three prompts re-timed steadily (2%, 4%, 6% apart), one disturbed once (its re-check at half speed).
    rows = [row("ar", 10.0, 0.0, prompt=p) for p in ("a", "b", "c", "d")]
    checks = [row("ar", 10.2, 50.0, prompt="a"), row("ar", 10.4, 50.0, prompt="b"),
              row("ar", 10.6, 50.0, prompt="c"), row("ar", 5.0, 50.0, prompt="d")]
    drift = baseline_drift(rows, checks)
    assert drift.noisy and drift.prompts == 4
    assert abs(drift.spread - 5.0 / 7.5) < 1e-9  # the disturbed prompt: (10 - 5) / median(10, 5)
    spreads = sorted([0.2 / 10.1, 0.4 / 10.2, 0.6 / 10.3, 5.0 / 7.5])
    assert abs(drift.typical - (spreads[1] + spreads[2]) / 2) < 1e-9
    assert "median 4.9%" in drift.describe() and "66.7%" in drift.describe()


@pytest.mark.slow
def test_sweep_rechecks_the_baseline_every_n_cells_and_after_each_prompt(tmp_path):
    model = tiny_model_dir(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{(i * 5 + j) % 60}" for j in range(10)),
                                           "category": "chat", "id": f"q{i}"}) + "\n" for i in range(2)))
    config = SweepConfig(targets=(str(model),), drafters=("ngram",), ks=(1, 2, 3, 4, 5), methods=("sps",),
                         datasets=(str(prompts),), limit=2, max_new_tokens=12, warmup=0, baseline_every=2,
                         host_baselines=False)
    store = ResultsStore(tmp_path / "s.sqlite")
    run_sweep(config, store, progress=False)
    store.close()
    checks = load_checks(tmp_path / "s.sqlite")
    # per prompt: 5 cells -> re-checks after cells 2, 4 and 5 (the last)
    assert sorted(c["prompt_id"] for c in checks) == ["q0"] * 3 + ["q1"] * 3
    rows, _, _ = load_study(tmp_path / "s.sqlite")
    assert all(r["finished_at"] for r in rows)
    assert baseline_drift(rows, checks).prompts == 2


def test_version_2_database_gains_finish_times_and_the_checks_table(tmp_path):
    path = tmp_path / "v2.sqlite"
    store = ResultsStore(path)
    store.add(Record(Cell("t", "none", 0, "ar", "d", 0.0, 16), "p1", "code", 16, 16, 0, 0, wall_s=1.0),
              store.start_run({}))
    store.close()
    conn = sqlite3.connect(path)  # make it a version-2 file, as draftlab 0.2.0's first cut wrote them
    conn.executescript("ALTER TABLE records DROP COLUMN finished_at; ALTER TABLE records DROP COLUMN levels_per_step; "
                       "ALTER TABLE records DROP COLUMN cache_held; "
                       "ALTER TABLE records DROP COLUMN concurrency; ALTER TABLE records DROP COLUMN window_tokens; "
                       "ALTER TABLE records DROP COLUMN latency_s; "
                       "DROP TABLE baseline_checks; "
                       "UPDATE meta SET value = '2' WHERE key = 'schema_version';")
    conn.close()
    store = ResultsStore(path)
    assert store.get_meta("schema_version") == SCHEMA_VERSION
    assert store.rows()[0]["finished_at"] is None and store.baseline_checks() == []
    assert store.rows()[0]["levels_per_step"] == []
    store.close()


class SlowerHalfway(ResultsStore):
    """A real study store whose host turns `factor` times slower once `after` records are stored: every later record
    and baseline re-check is stored with its times scaled. Synthetic timings, so the test does not rest on how this
    host's scheduler shares its cores."""

    def __init__(self, path, after: int, factor: float) -> None:
        super().__init__(path)
        self.after, self.factor, self.stored = after, factor, 0

    def add(self, record, run_id) -> None:
        super().add(self._timed(record), run_id)
        self.stored += 1

    def add_baseline_check(self, record, run_id) -> None:
        super().add_baseline_check(self._timed(record), run_id)

    def _timed(self, record):
        if self.stored < self.after:
            return record
        scaled = {name: getattr(record, name) * self.factor
                  for name in ("prefill_s", "draft_s", "target_s", "overhead_s", "wall_s")}
        return replace(record, **scaled)


@pytest.mark.slow
def test_a_host_that_slows_down_halfway_flags_the_study_as_noisy(tmp_path):
    """The sweep re-times its baseline; where the host turned slower after the baseline and two cells, the re-checks
    disagree with the first timing, and the study (its drift line and its report) says NOISY."""
    model = tiny_model_dir(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": " ".join(f"w{j % 60}" for j in range(10)), "category": "chat",
                                   "id": "q0"}) + "\n")
    config = SweepConfig(targets=(str(model),), drafters=("ngram",), ks=(1, 2, 3, 4), methods=("sps",),
                         datasets=(str(prompts),), limit=1, max_new_tokens=48, warmup=1, baseline_every=2)
    store = SlowerHalfway(tmp_path / "s.sqlite", after=3, factor=8.0)  # the baseline and 2 cells at the host's pace
    try:
        run_sweep(config, store, progress=False)
    finally:
        store.close()
    rows, _, _ = load_study(tmp_path / "s.sqlite")
    checks = load_checks(tmp_path / "s.sqlite")
    drift = baseline_drift(rows, checks)
    (timings,) = baseline_timings(rows, checks).values()  # the baseline, then its re-checks on the slower host
    assert len(timings) >= 3 and drift.prompts == 1 and drift.noisy, drift.describe()
    assert "NOISY" in build_report(tmp_path / "s.sqlite", tmp_path / "report").read_text()

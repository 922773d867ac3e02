"""A preset that names the seeds' other inputs makes them after its sweep: the calibration profile and the
depth-vs-width microbenchmark, which turn two findings from "not measured" into measured; kept on a resume."""

from __future__ import annotations

from draftlab.study.answer.findings import NOT_MEASURED
from draftlab.study.answer.results import ReportInputs, StudyResults
from draftlab.study.run.seed_inputs import make_seed_inputs
from draftlab.study.run.store import ResultsStore
from draftlab.study.run.sweep import SweepConfig, run_sweep
from tests.conftest import tiny_model_dir


def test_a_preset_makes_the_profile_and_microbenchmark_its_findings_read(tmp_path, capsys):
    model = tiny_model_dir(tmp_path / "model")
    config = SweepConfig(targets=(str(model),), drafters=("ngram", "layers:0-1"), ks=(1, 3), methods=("sps",),
                         datasets=("mixed",), limit=2, max_new_tokens=8, warmup=0, baseline_every=0, dtype="fp32",
                         host_baselines=False, preflight_s=0, seed_inputs=("calibrate", "microbench"))
    db = tmp_path / "study.sqlite"
    store = ResultsStore(db)
    run_sweep(config, store, progress=False)
    store.close()
    before = StudyResults.load(db)
    assert [f.verdict for f in before.findings][2] == NOT_MEASURED and before.findings[4].verdict == NOT_MEASURED

    seeds = make_seed_inputs(config, tmp_path, progress=False)
    assert seeds.profile == tmp_path / "profile.json" and seeds.microbench == tmp_path / "microbench.json"
    results = StudyResults.load(db, ReportInputs(seeds.profile, seeds.microbench))
    depth, error = results.findings[2], results.findings[4]
    assert depth.verdict != NOT_MEASURED and "the layers cost" in depth.measured
    assert error.verdict != NOT_MEASURED and "over 4 cells the model is off by" in error.measured  # 2 drafts x 2 K
    assert "calibrate for the seeds' findings" in capsys.readouterr().out

    stamps = (seeds.profile.stat().st_mtime_ns, seeds.microbench.stat().st_mtime_ns)
    assert make_seed_inputs(config, tmp_path, progress=False) == seeds  # a resumed study keeps what it made
    assert (seeds.profile.stat().st_mtime_ns, seeds.microbench.stat().st_mtime_ns) == stamps


def test_a_seed_input_that_cannot_be_made_is_one_line_and_the_rest_goes_on(tmp_path, capsys):
    model = tiny_model_dir(tmp_path / "model")
    config = SweepConfig(targets=(str(model),), drafters=("designed",), ks=(1,), methods=("sps",), limit=1,
                         max_new_tokens=4, dtype="fp32", seed_inputs=("calibrate", "microbench"))
    seeds = make_seed_inputs(config, tmp_path, progress=False)
    assert seeds.profile is None and seeds.microbench is not None and not (tmp_path / "profile.json").exists()
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("study: no calibrate")]
    assert len(line) == 1 and "no draft of the grid runs on" in line[0]

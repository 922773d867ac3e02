"""The racing tuner: contenders from predicted intervals, successive halving, a budget that holds."""

from __future__ import annotations

import pytest

from draftlab.files.datasets import Prompt
from draftlab.errors import DraftlabError
from draftlab.models import load_model
from draftlab.perf.calibrate import CalibrationSettings
from draftlab.perf.throughput import DraftProfile, TargetProfile, predict
from draftlab.perf.halving import plan_race
from draftlab.perf.sizing import MIN_CALIBRATION_TOKENS, CalibrationCost, Pilot, TuneSettings, fit_calibration
from draftlab.perf.tuner import contenders, tune
from tests.conftest import tiny_model_dir

DRAFTS = ["ngram", "ngram:2-4", "layers:0-1", "layers:0-2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(tiny_model_dir(tmp_path_factory.mktemp("tune") / "tiny")))


def prompts(n):
    return [Prompt(f"p{i}", "chat", " ".join(f"w{(i * 11 + j * j) % 60}" for j in range(24)), chat=False)
            for i in range(n)]


def test_intervals_widen_with_fewer_steps_and_contenders_overlap_the_best():
    target = TargetProfile("t", {1: 0.010, 2: 0.011, 3: 0.012}, score_spread={1: 0.02, 2: 0.02, 3: 0.02})
    sure = DraftProfile("a", 0.001, [0.6, 0.3], steps=10_000)
    unsure = DraftProfile("a", 0.001, [0.6, 0.3], steps=10)
    p_sure, p_unsure = predict(target, sure, 2), predict(target, unsure, 2)
    assert p_sure.tokens_per_s == pytest.approx(p_unsure.tokens_per_s)
    assert p_unsure.tokens_per_s_low < p_sure.tokens_per_s_low < p_sure.tokens_per_s < p_sure.tokens_per_s_high
    far_behind = predict(target, DraftProfile("b", 0.02, [0.05, 0.0], steps=10_000), 1)
    picked = contenders([p_sure, far_behind], limit=4)
    assert p_sure in picked and far_behind not in picked


def test_tune_races_and_recommends_a_measured_configuration(tiny):
    settings = CalibrationSettings(k_max=3, max_new_tokens=24, repeats=3)
    rec, profile, preds = tune(tiny, DRAFTS[:2], prompts(3), settings, progress=False)
    assert rec.race and rec.measured_tokens_per_s and rec.measured_tokens_per_s > 0
    assert (rec.draft, rec.k) in {(p.draft, p.k) for p in preds} | {("none", 0)}
    sizes = [len(r["speedups"]) for r in rec.race]
    assert sizes == sorted(sizes, reverse=True)  # the field only shrinks


@pytest.mark.parametrize("per_token_s, prefill_s", [(0.001, 0.005), (0.01, 0.05), (0.05, 0.5)])
@pytest.mark.parametrize("budget", [3.0, 6.0, 60.0])
def test_the_budget_is_planned_to_hold_on_hosts_of_any_speed(per_token_s, prefill_s, budget):
    """From a pilot's timings (synthetic: a fast, a middling and a slow host), the calibration is sized to its share
    of the budget, and the race to what is left, each by the same estimates the tuner then runs by."""
    pilot = Pilot(per_token_s, prefill_s)
    settings, tune_settings = CalibrationSettings(k_max=4, max_new_tokens=48, repeats=5), TuneSettings(budget_s=budget)
    fitted, kept, notes = fit_calibration(pilot, prompts(24), DRAFTS, settings, tune_settings)
    calibration_s = CalibrationCost(pilot, fitted, len(DRAFTS)).seconds(len(kept), fitted.max_new_tokens)
    least = (len(kept), fitted.max_new_tokens) == (1, MIN_CALIBRATION_TOKENS)  # the least calibration there is
    assert calibration_s <= budget * tune_settings.calibration_share or least
    assert bool(notes) == (len(kept) < 24 or fitted.max_new_tokens < 48)  # it says what the budget left out
    plan = plan_race(tune_settings.max_contenders, len(kept), settings.max_new_tokens, pilot, budget - calibration_s)
    assert plan is None or plan.seconds(pilot) <= budget - calibration_s


@pytest.mark.slow
def test_a_tune_with_a_budget_says_what_the_budget_left_out(tiny):
    settings = CalibrationSettings(k_max=4, max_new_tokens=48, repeats=5)
    rec, _, _ = tune(tiny, DRAFTS, prompts(24), settings, TuneSettings(budget_s=0.05), progress=False)
    assert any("of 24 prompts" in note for note in rec.notes)  # too short for any host: it says what it left out
    assert (rec.draft, rec.k) == ("none", 0) and any("no time to race" in note for note in rec.notes)


@pytest.mark.slow
def test_tune_and_sweep_read_a_users_mt_bench_file(tmp_path, capsys):
    """`tune --prompts FILE --json` and `sweep --prompts FILE` on a user's MT-Bench-format questions."""
    import json

    from draftlab.cli import main
    from draftlab.study.run.store import ResultsStore

    model = tiny_model_dir(tmp_path / "tiny")
    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps({"question_id": 80 + i, "category": c, "turns": [
        " ".join(f"w{(i * 13 + j) % 60}" for j in range(20)), "a second turn"]}) + "\n"
        for i, c in enumerate(["writing", "coding", "math"])))
    assert main(["tune", "--target", str(model), "--prompts", str(questions), "--drafts", "ngram", "--k-max", "2",
                 "--max-new-tokens", "16", "--repeats", "2", "--no-progress", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["draft"] in ("ngram", "none") and result["race"]
    db = tmp_path / "s.sqlite"
    assert main(["sweep", "--db", str(db), "--targets", str(model), "--prompts", str(questions), "--drafters", "ngram",
                 "--ks", "1", "--methods", "sps", "--limit", "3", "--max-new-tokens", "8", "--warmup", "0",
                 "--no-progress"]) == 0
    store = ResultsStore(db)
    assert {r["prompt_id"] for r in store.rows()} == {"80", "81", "82"}
    store.close()
    profile = tmp_path / "profile.json"
    assert main(["calibrate", "--target", str(model), "--prompts", str(questions), "--drafts", "ngram", "--k-max", "1",
                 "--max-new-tokens", "8", "--repeats", "2", "--no-progress", "--out", str(profile)]) == 0
    capsys.readouterr()
    assert main(["validate", "--profile", str(profile), "--db", str(db)]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert "anchored to the study's plain decoding" in out and summary["anchored"]["cells"] == summary["cells"] == 1


def test_race_plan_keeps_every_prompt_and_full_length_runs_and_fits_the_time_left():
    from draftlab.perf.sizing import Pilot
    from draftlab.perf.halving import plan_race

    unlimited = plan_race(4, 3, 48, None, float("inf"))
    assert (unlimited.contenders, unlimited.prompts, unlimited.tokens) == (4, 3, 48)
    assert unlimited.field_sizes() == [4, 2, 1]  # the whole halving schedule, every round at full length
    assert plan_race(1, 2, 48, None, float("inf")).field_sizes() == [1, 1]  # one contender still runs twice
    pilot = Pilot(per_token_s=1 / 48, prefill_s=0.1)  # a full plain generation takes 1.1 s
    for seconds in (3.0, 8.0, 15.0, 25.0, 40.0):
        assert plan_race(4, 2, 48, pilot, seconds).seconds(pilot) <= seconds
    short = plan_race(4, 2, 48, pilot, 8.0)
    assert short.prompts == 2 and short.tokens == 48 and short.contenders < 4  # every prompt, full runs first
    assert plan_race(1, 2, 48, pilot, 11.0).field_sizes() == [1, 1]  # time for a second look at one contender
    assert plan_race(4, 2, 48, pilot, 15.0).field_sizes() == [4]  # more contenders before more rounds
    cut = plan_race(4, 2, 48, pilot, 3.0)
    assert cut.prompts == 2 and cut.contenders == 1 and 16 <= cut.tokens < 48  # shorter runs before fewer prompts
    roomy = plan_race(4, 2, 48, pilot, 40.0)
    assert roomy.contenders == 4 and roomy.field_sizes() == [4, 2, 1]  # time to spare: the whole schedule
    assert plan_race(4, 2, 48, pilot, 0.8) is None  # not one contender on one prompt fits


def test_calibration_keeps_half_length_runs_before_every_prompt_and_two_prompts_before_length():
    from draftlab.perf.sizing import CalibrationCost, Pilot, calibration_size

    pilot = Pilot(per_token_s=1 / 48, prefill_s=0.1)
    settings = CalibrationSettings(k_max=7, max_new_tokens=48, repeats=3, short_run_prompts=1)
    cost = CalibrationCost(pilot, settings, drafts=3)
    assert calibration_size(cost, 4, 1000.0) == (4, 48)
    between = (cost.seconds(4, 24) + cost.seconds(4, 48)) / 2
    prompts, tokens = calibration_size(cost, 4, between)
    assert prompts == 4 and 24 <= tokens < 48 and cost.seconds(4, tokens) <= between  # shorter runs, every prompt
    prompts, tokens = calibration_size(cost, 4, cost.seconds(4, 24) - 0.01)
    assert prompts < 4 and tokens >= 24  # fewer prompts before runs shorter than half the length
    assert cost.seconds(prompts, tokens) <= cost.seconds(4, 24) - 0.01
    assert calibration_size(cost, 4, cost.seconds(2, 18)) == (2, 18)  # shorter runs on two prompts before one prompt
    assert calibration_size(cost, 4, cost.seconds(1, 18)) == (1, 18)  # not two prompts at 12 tokens: one
    one_draft = CalibrationCost(pilot, settings, 1)
    assert cost.seconds(2, 48) - one_draft.seconds(2, 48) > one_draft.seconds(2, 48)  # cost grows with drafts
    assert calibration_size(cost, 4, 0.1) == (1, 12)  # nothing fits: the smallest calibration


def test_contenders_put_the_predicted_best_first_then_the_highest_interval_ends():
    target = TargetProfile("t", {n: 0.010 + 0.001 * n for n in range(1, 6)}, score_spread={n: 0.2 for n in range(1, 6)})
    strong = DraftProfile("a", 0.0005, [0.7, 0.5, 0.4, 0.3], steps=50)
    unsure = DraftProfile("b", 0.0005, [0.6, 0.4, 0.3, 0.2], steps=50, prompt_tar_se=[0.3, 0.6, 0.9, 1.2])
    preds = [predict(target, d, k) for d in (strong, unsure) for k in range(1, 5)]
    picked = contenders(preds, limit=3)
    assert picked[0] == max(preds, key=lambda p: p.tokens_per_s) and picked[0].draft == "a"
    rest = sorted((p for p in preds if p is not picked[0]), key=lambda p: -p.tokens_per_s_high)
    assert picked[1:] == rest[:2] and picked[1].draft == "b"  # the widest interval: its high end could win
    assert picked[1].tokens_per_s < max(p.tokens_per_s for p in preds if p.draft == "a" and p is not picked[0])


@pytest.mark.slow
def test_tune_searches_the_dtype_and_races_the_picks(tmp_path, capsys):
    """Each dtype tuned, the picks and reference plain decoding raced head to head; outputs compared."""
    import json

    from draftlab.cli import main
    from draftlab.perf.tuner import tune_dtypes

    model = tiny_model_dir(tmp_path / "tiny")
    settings = CalibrationSettings(k_max=2, max_new_tokens=16, repeats=2)
    choice = tune_dtypes(lambda dtype: load_model(str(model), dtype=dtype), ["fp32", "bf16"], DRAFTS[:1], prompts(3),
                         settings, TuneSettings(budget_s=12.0), progress=False)
    assert list(choice.per_dtype) == ["fp32", "bf16"] and choice.dtype in ("fp32", "bf16")
    assert "fp32 plain decoding" in choice.head_to_head and len(choice.head_to_head) >= 2
    same, total = choice.identical
    assert total >= 1 and choice.speedup > 0
    assert choice.dtype != "fp32" or same == total  # in the reference dtype: lossless against its plain decoding
    assert main(["tune", "--target", str(model), "--dtypes", "fp32", "bf16", "--drafts", "ngram", "--k-max", "2",
                 "--max-new-tokens", "12", "--repeats", "2", "--limit", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["dtype"] in ("fp32", "bf16") and result["reference_dtype"] == "fp32"
    assert set(result["per_dtype"]) == {"fp32", "bf16"} and "head to head:" in out
    with pytest.raises(Exception, match="distinct dtypes"):
        tune_dtypes(lambda dtype: None, ["bf16", "bf16"], DRAFTS[:1], prompts(1), settings)


def _record(method, drafter, k, prompt, tokens, wall_s, prefill_s, steps, finished_at):
    return {"target": "t", "dataset": "d", "temperature": 0.0, "prompt_id": prompt, "method": method,
            "drafter": drafter, "k": k, "new_tokens": tokens, "wall_s": wall_s, "prefill_s": prefill_s,
            "steps": steps, "target_s": wall_s - prefill_s, "draft_s": 0.0, "overhead_s": 0.0,
            "finished_at": finished_at}


def test_anchored_validation_cancels_the_machines_speed_between_calibration_and_study():
    from draftlab.perf.calibrate import Profile
    from draftlab.perf.validate import compare, error_summary

    target = TargetProfile("t", {1: 0.010, 2: 0.010}, score_spread={1: 0.01, 2: 0.01})  # plain decoding 100 tok/s
    profile = Profile(target, [DraftProfile("ngram", 0.0, [1.0], steps=1000)])  # predicts 200 tok/s at K=1
    # The study ran at half calibration's speed on prompt a, and on prompt b slowed from half to a quarter
    # between its ar record and a re-timing taken right after its sps cell.
    rows = [_record("ar", "none", 0, "a", 50, 1.1, 0.1, 50, 1.0), _record("sps", "ngram", 1, "a", 50, 0.5, 0.0, 25, 2.0),
            _record("ar", "none", 0, "b", 50, 1.1, 0.1, 50, 3.0), _record("sps", "ngram", 1, "b", 50, 1.0, 0.0, 25, 4.0)]
    checks = [{"target": "t", "dataset": "d", "temperature": 0.0, "prompt_id": "b", "new_tokens": 50,
               "wall_s": 2.1, "finished_at": 4.0}]
    absolute = compare(profile, rows)[0]
    assert absolute.simplified_tokens_per_s == pytest.approx(200.0) and absolute.measured_tokens_per_s == pytest.approx(
        100 / 1.5) and not absolute.inside_interval
    anchored = compare(profile, rows, checks)[0]
    assert anchored.anchor == pytest.approx(100 / 1.5 / 200) and anchored.simplified_error == pytest.approx(0.0)
    assert anchored.inside_interval and error_summary([anchored])["simplified_max_error"] == pytest.approx(0.0)
    # without the re-timing prompt b is anchored to its earlier, faster plain decoding
    assert compare(profile, rows, [])[0].anchor == pytest.approx(0.5)
    with pytest.raises(DraftlabError, match="no plain decoding record"):
        compare(profile, [r for r in rows if r["prompt_id"] != "a" or r["method"] != "ar"], [])

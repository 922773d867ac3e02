"""A study within a budget: the pilot's drops, the plan of prompts that fit, the deadline that keeps to it."""

from __future__ import annotations

import json

from draftlab.study.run.budget import PILOT_REASON, Deadline, Pilot, PlanLimits, make_plan, pilot_drops
from draftlab.study.run.cells import Cell
from draftlab.study.run.store import ResultsStore
from draftlab.study.run.sweep import SweepConfig, run_sweep
from tests.conftest import tiny_model_dir


def cell(method, drafter="none", k=0, target="m"):
    return Cell(target, drafter, k, method, "d", 0.0, 100)


def test_the_pilot_drops_a_hopeless_cell_never_a_baseline_nor_a_peers_plain_decoding_in_use():
    ar, fast, slow = cell("ar"), cell("sps", "ngram", 1), cell("sps", "ngram", 3)
    llama, lookup = cell("llama", target="llamacpp:m"), cell("lcp", "ngram", 1, target="llamacpp:m")
    pilot = Pilot(decode={ar.key: 0.1, fast.key: 0.01, slow.key: 0.05, llama.key: 0.2, lookup.key: 0.02})
    drops = pilot_drops([ar, fast, slow, llama, lookup], pilot)
    assert set(drops) == {slow.key} and drops[slow.key].startswith(PILOT_REASON)  # 5x slower; ar is the baseline
    assert "20.0 tok/s" in drops[slow.key] and "100.0 tok/s" in drops[slow.key]


def test_the_plan_takes_the_most_prompts_that_fit_and_at_least_the_races_first():
    ar, spec = cell("ar"), cell("sps", "ngram", 1)
    pilot = Pilot(prefill={"draftlab": 0.001}, decode={ar.key: 0.01, spec.key: 0.008},
                  keys={ar.key: "draftlab", spec.key: "draftlab"})
    lengths = [1000, 10, 100, 100, 100, 100]  # the race's order: the longest and the shortest first
    full = make_plan({"m": [ar, spec]}, {"m": pilot}, lengths, PlanLimits(2, 1, 0.0))
    assert full.prompts == 6 and len(full.costs) == 6 and full.costs[0] > full.costs[2]
    # each prompt: 100 tokens of ar (1 s) and of spec (0.8 s), the baseline re-timed once (1 s), the prefill
    assert abs(full.costs[2] - (100 * 0.01 + 100 * 0.008 + 100 * 0.01 + 100 * 0.001)) < 1e-9
    slower = Pilot(pilot.prefill, {ar.key: 0.01, spec.key: 0.02}, pilot.keys)  # the race is expected to drop it
    assert abs(make_plan({"m": [ar, spec]}, {"m": slower}, lengths, PlanLimits(2, 1, 0.0)).costs[2] - 1.1) < 1e-9
    fits = make_plan({"m": [ar, spec]}, {"m": pilot}, lengths, PlanLimits(2, 1, sum(full.costs[:4]) + 0.1))
    assert fits.prompts == 4 and "4 of 6 prompts x 2 cells x 100 tokens" in fits.line()
    least = make_plan({"m": [ar, spec]}, {"m": pilot}, lengths, PlanLimits(2, 1, 1.0))
    assert least.prompts == 2 and "over the" in least.line()


def test_the_deadline_expects_the_next_prompt_as_planned_scaled_by_the_prompts_so_far():
    deadline = Deadline(100.0, planned=(40.0, 5.0, 10.0, 10.0))
    assert deadline.affords_another()
    deadline.prompt_s += [60.0, 7.5]  # the host ran 1.5x slower than planned
    assert abs(deadline.next_prompt_s() - 15.0) < 1e-9
    assert Deadline(100.0, prompt_s=[10.0, 20.0]).next_prompt_s() == 15.0  # no plan (resumed): the mean


def test_a_budgeted_sweep_prints_its_plan_keeps_it_and_stores_the_pilots_drops(tmp_path, capsys):
    model = tiny_model_dir(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{(i * 5 + j) % 60}" for j in range(10 + 7 * i)),
                                           "category": "chat", "id": f"q{i}"}) + "\n" for i in range(5)))
    config = SweepConfig(targets=(str(model),), drafters=("ngram",), ks=(1, 2), methods=("sps",),
                         datasets=(str(prompts),), limit=5, max_new_tokens=12, warmup=1, baseline_every=2,
                         host_baselines=False, race_after=2, budget_s=0.01, preflight_s=0)
    store = ResultsStore(tmp_path / "s.sqlite")
    run_sweep(config, store, progress=False)
    plan_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("plan: "))
    assert "2 of 5 prompts" in plan_line and "over the" in plan_line  # 10 ms afford only the race's first
    ran = {r["prompt_id"] for r in store.rows()}
    assert len(ran) == 2 and store.get_meta("plan:" + str(prompts) + ":0") == "2"
    assert run_sweep(config, store, progress=False) == 0  # a second run keeps the plan: nothing left
    store.close()

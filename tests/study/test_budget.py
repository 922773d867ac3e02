"""A study within a budget: the pilot's drops, the plan of prompts that fit, the deadline that keeps to it."""

from __future__ import annotations

import json
from dataclasses import replace

from draftlab.decoding.metrics import GenerationStats
from draftlab.measure import RunRecord
from draftlab.study.run.budget import (PILOT_REASON, PLAN_REASON, Deadline, Pilot, PlanLimits, decode_rate, make_plan,
                                      pilot_drops)
from draftlab.study.run.cells import Cell
from draftlab.study.run.growth import Growth
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


def test_the_pilot_spreads_a_draft_models_prefill_over_the_cells_output_not_its_own_16_tokens():
    """A 16-token pilot of a 64-token cell: the draft's prefill of the prompt (in the first step) counts once per
    output, so a quarter of it per pilot token; a cell without one keeps its plain rate."""
    spec = Cell("m", "model:d", 3, "sps", "d", 0.0, 64)
    # 5 steps: the first drafted in 1.0 s, the other four in 0.1 s each: 0.9 s of it is the draft's prefill
    stats = GenerationStats(steps=5, draft_s=1.4, first_draft_s=1.0)
    assert abs(stats.draft_prefill_s - 0.9) < 1e-9
    record = RunRecord(spec.key, "p", "c", list(range(16)), stats, True)
    assert abs(decode_rate(record, 2.0, spec) - ((2.0 - 0.9) / 16 + 0.9 / 64)) < 1e-9
    ngram = RunRecord(spec.key, "p", "c", list(range(16)), GenerationStats(steps=5, draft_s=0.01, first_draft_s=0.002),
                      True)
    assert abs(decode_rate(ngram, 2.0, spec) - 2.0 / 16) < 1e-9
    assert GenerationStats(steps=1, draft_s=1.0, first_draft_s=1.0).draft_prefill_s == 0.0  # no later step to compare


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
    fits = make_plan({"m": [ar, spec]}, {"m": pilot}, lengths, PlanLimits(2, 1, sum(full.costs[:5]) + 0.1))
    assert fits.prompts == 5 and "5 of 6 prompts x 2 cells x 100 tokens" in fits.line() and not fits.budget_drops
    least = make_plan({"m": [ar, spec]}, {"m": pilot}, lengths, PlanLimits(2, 1, 1.0))
    assert least.prompts == 5 and "over the" in least.line()  # 5 of 6 (PROMPT_SHARE): over, with the baseline alone
    assert set(least.budget_drops) == {spec.key} and least.budget_drops[spec.key].startswith(PLAN_REASON)


def test_a_cell_that_prefills_each_prompt_itself_has_that_prefill_in_the_plan():
    """`draftlab serve` requests share no prefill (each prefills its prompt, timed apart by the server): the plan
    counts that prefill once per such cell and prompt, beside the shared one of the keyed engines."""
    ar, serve, served_spec = cell("ar"), cell("serve-ar"), cell("serve", "ngram", 1)
    pilot = Pilot(prefill={"draftlab": 0.001}, decode={ar.key: 0.01, serve.key: 0.01, served_spec.key: 0.008},
                  keys={ar.key: "draftlab", serve.key: "", served_spec.key: ""},
                  own_prefill={serve.key: 0.002, served_spec.key: 0.003})
    plan = make_plan({"m": [ar, serve, served_spec]}, {"m": pilot}, [100, 100], PlanLimits(0, 0, 0.0))
    decode = 100 * (0.01 + 0.01 + 0.008)
    assert abs(plan.costs[0] - (decode + 100 * 0.001 + 100 * (0.002 + 0.003))) < 1e-9
    assert plan.prefills == 1 and plan.own_prefills == 2  # one shared prefill a prompt; the servers' own are theirs
    assert "2 cell(s) prefill each prompt in their own requests (draftlab serve)" in plan.line()


def test_a_long_prompt_is_priced_at_the_baselines_costs_timed_on_it():
    """The baseline timed on the pilot's prompt (100 tokens) and on the longest (1100): a prompt token's prefill 1.5x
    and a new token 3x there. The plan prices each prompt's prefill and decode at its own context, every cell of the
    target alike; a prompt as long as the pilot's, decoding more tokens than the pilot did, costs a little more."""
    growth = Growth.timed(100, 16, 1100, prefill=(0.001, 0.0015), decode=(0.01, 0.03))
    assert abs(growth.prefill_factor(1100) - 1.5) < 1e-9 and abs(growth.decode_factor(1100, 16) - 3.0) < 1e-9
    assert abs(growth.decode_factor(100, 116) - 1.1) < 1e-9  # 50 more tokens of context on average: 2e-3 each
    assert abs(growth.decode_factor(0, 2) - (1.0 - 0.002 * 107)) < 1e-9  # a shorter prompt: less, down to FLOOR
    assert Growth.timed(100, 16, 1100, (0.001, 0.0009), (0.01, 0.01)) == Growth(100, 16, 1100)  # noise: no growth
    ar, spec = cell("ar"), cell("sps", "ngram", 1)
    flat = Pilot(prefill={"draftlab": 0.001}, decode={ar.key: 0.01, spec.key: 0.008},
                 keys={ar.key: "draftlab", spec.key: "draftlab"})
    grown = replace(flat, growth=growth)
    lengths, limits = [1100, 100], PlanLimits(0, 0, 0.0)
    before, after = (make_plan({"m": [ar, spec]}, {"m": p}, lengths, limits).costs for p in (flat, grown))
    decode_at = lambda length: 100 * (0.01 + 0.008) * growth.decode_factor(length, 100)  # noqa: E731
    assert abs(after[0] - (1100 * 0.001 * 1.5 + decode_at(1100))) < 1e-9 and after[0] > 2 * before[0]
    assert abs(after[1] - (100 * 0.001 + decode_at(100))) < 1e-9 and before[1] < after[1] < 1.2 * before[1]
    assert "on the longest prompt (1100 tokens)" in growth.words() and Growth().words() == ""


def test_servers_that_do_not_fit_at_once_are_started_again_on_every_prompt_in_the_plan():
    """Three servers where two fit at once (the pilot stopped one to start another): each prompt starts all three
    again, and the plan says so; once the race keeps two of them, or where all fit, no start is priced."""
    ar = cell("ar")
    served = [cell("serve", "ngram", k) for k in (1, 2, 3)]
    decode = {ar.key: 0.01, served[0].key: 0.005, served[1].key: 0.005, served[2].key: 0.02}
    crowded = Pilot({"draftlab": 0.001}, decode, {ar.key: "draftlab"}, servers={c.key for c in served},
                    start_s={c.key: 4.0 for c in served[:2]}, room=2)  # the third ran since the warm-up: 4 s too
    plan = make_plan({"m": [ar, *served]}, {"m": crowded}, [100] * 4, PlanLimits(2, 0, 0.0))
    roomy = make_plan({"m": [ar, *served]}, {"m": replace(crowded, room=0)}, [100] * 4, PlanLimits(2, 0, 0.0))
    assert abs(plan.costs[0] - roomy.costs[0] - 12.0) < 1e-9  # the race's first prompts: all three start again
    assert plan.costs[2] == roomy.costs[2]  # after the race: the slowest server dropped, the two left fit
    assert "each prompt starts them again, about 12 s a prompt" in plan.line()
    assert "starts them again" not in roomy.line()


def test_a_budget_that_cannot_hold_the_prompts_leaves_out_the_most_hopeless_cells_first():
    """Shaped like the AMX host: draftlab's torch engine within 3x of llama.cpp's decode and prefilling 10x faster,
    seven llama.cpp engines that each prefill the prompt; 8 prompts of 128 tokens in 8 minutes. The plan keeps at
    least 6 of the 8 prompts for every cell it keeps, leaving out the slowest cells (never a baseline, nor a peer's
    plain decoding whose speculation runs), and its estimate is what those cells cost by the pilot's timings."""
    BUDGET = 300.0  # all cells on every prompt would take about twice that
    torch_cells = [cell("ar"), *(cell("sps", d, k) for d in ("ngram", "designed") for k in (1, 2, 3))]
    llama = "llamacpp:m"
    llama_cells = [cell("ar", target=llama), cell("llama", target=llama), cell("server-ar", target=llama),
                   *(cell("sps", d, k, llama) for d in ("ngram", "designed") for k in (1, 2, 3)),
                   *(cell("lcp", "ngram", k, llama) for k in (1, 2, 3)),
                   *(cell("server", t, 0, llama) for t in ("ngram-mod", "ngram-simple", "draft-simple"))]
    engine = {"ar": "draftlab", "sps": "draftlab", "llama": "llama-cpp-python", "lcp": "llama-cpp-python lookup"}
    keys = {c.key: "torch" if c.target == "m" else c.drafter if c.method == "server" else engine.get(c.method, c.method)
            for c in torch_cells + llama_cells}  # seven llama.cpp engines, each prefilling the prompt apart
    decode = {c.key: 1 / 26 if c.target == "m" else 1 / 65 for c in torch_cells + llama_cells}
    decode.update({c.key: 1 / 20 for c in torch_cells[4:]} | {c.key: 1 / 45 for c in llama_cells[6:9]})
    prefill = {key: (0.48 if key == "torch" else 9.0) / 1344 for key in set(keys.values())}  # per prompt token
    torch_pilot = Pilot(prefill, {c.key: decode[c.key] for c in torch_cells}, {c.key: keys[c.key] for c in torch_cells})
    llama_pilot = Pilot(prefill, {c.key: decode[c.key] for c in llama_cells}, {c.key: keys[c.key] for c in llama_cells})
    lengths = [1344, 40, 300, 200, 150, 400, 250, 120]  # the race's order: the longest, the shortest, then the rest
    plan = make_plan({"m": torch_cells, llama: llama_cells}, {"m": torch_pilot, llama: llama_pilot}, lengths,
                     PlanLimits(2, 6, BUDGET))
    assert plan.prompts >= 6 and plan.estimate_s <= BUDGET, plan.line()
    dropped = set(plan.budget_drops)
    assert dropped and not {c.key for c in (torch_cells[0], llama_cells[0])} & dropped  # the baselines stay
    kept = [c for c in torch_cells + llama_cells if c.key not in dropped]
    assert any(c.method == "lcp" for c in kept) <= (llama_cells[1].key not in dropped)  # a peer's reference stays
    slowest = max(decode[c.key] for c in kept if c.method not in ("ar",))
    assert all(decode[key] >= slowest * 0.999 for key in dropped if not key.startswith("llamacpp:m|llama|"))


def test_neither_the_plan_nor_the_pilot_leaves_out_what_a_deploy_line_answers_from():
    """Shaped like the quick study on a fast host (CI, 0.30.0): every server decodes slower than llama.cpp's
    fastest cell and the budget holds only a few cells, so the plan used to leave out every llama-server cell and
    the study printed no llama-server command. Each server's plain decoding and its fastest speculation by the
    pilot stay, whatever the budget; the rest of the servers' cells are left out like any other."""
    llama = "llamacpp:m"
    rates = {cell("ar", target=llama): 70.0, cell("llama", target=llama): 68.0,
             **{cell("lcp", "ngram", k, llama): r for k, r in ((1, 88.8), (2, 80.0), (3, 69.0))},
             **{cell("sps", "suffix", k, llama): r for k, r in ((1, 75.0), (2, 72.0), (3, 70.0))},
             cell("serve-ar", target=llama): 67.0,
             **{cell("serve", d, k, llama): r for d in ("ngram", "suffix") for k, r in ((1, 66.0 + len(d)), (2, 64.0),
                                                                                         (3, 55.0))},
             cell("server-ar", target=llama): 67.3, cell("server", "ngram-mod", 3, llama): 60.5,
             cell("server", "ngram-simple", 3, llama): 63.0}
    cells = list(rates)
    pilot = Pilot({"e": 0.0}, {c.key: 1 / r for c, r in rates.items()}, {c.key: "e" for c in cells})
    plan = make_plan({llama: cells}, {llama: pilot}, [100] * 8, PlanLimits(2, 2, 60.0))
    kept = {c.key for c in cells} - set(plan.budget_drops)
    deployed = {cell("server-ar", target=llama).key, cell("server", "ngram-simple", 3, llama).key,
                cell("serve-ar", target=llama).key, cell("serve", "suffix", 1, llama).key}
    assert deployed <= kept, plan.budget_drops
    assert cell("server", "ngram-mod", 3, llama).key in plan.budget_drops  # the slower server type: left out
    slow = Pilot({}, {**pilot.decode, cell("server-ar", target=llama).key: 1 / 20.0,
                      cell("server", "ngram-mod", 3, llama).key: 1 / 10.0}, {})
    # 4.4x slower than the fastest, the server's plain decoding stays; its slower type does not
    assert set(pilot_drops(cells, slow)) == {cell("server", "ngram-mod", 3, llama).key}
    slower = Pilot({}, {**slow.decode, cell("server", "ngram-simple", 3, llama).key: 1 / 5.0}, {})
    assert set(pilot_drops(cells, slower)) == {cell("server", "ngram-simple", 3, llama).key}  # now the slower


def test_the_pilots_own_time_comes_off_the_budget_the_plan_fits_in():
    assert PlanLimits(2, 1, 10.0).after(4.0).budget_s == 6.0 and PlanLimits(2, 1, 3.0).after(4.0).budget_s == 1e-3
    assert PlanLimits(2, 1, 0.0).after(4.0).budget_s == 0.0  # no budget: none after the pilot either


def test_the_deadline_expects_the_next_prompt_as_planned_scaled_by_the_prompts_so_far():
    deadline = Deadline(100.0, planned=(40.0, 5.0, 10.0, 10.0))
    assert deadline.affords_another()
    deadline.prompt_s += [60.0, 7.5]  # the host ran 1.5x slower than planned
    assert abs(deadline.next_prompt_s() - 15.0) < 1e-9
    assert Deadline(100.0, prompt_s=[10.0, 20.0]).next_prompt_s() == 15.0  # no plan (resumed): the mean


def test_a_budgeted_sweep_prints_its_plan_keeps_it_and_stores_the_pilots_drops(tmp_path, capsys):
    model = tiny_model_dir(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    lengths = [10, 17, 24, 31, 80]  # the longest over twice the median: the baseline is timed on it too
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{(i * 5 + j) % 60}" for j in range(length)),
                                           "category": "chat", "id": f"q{i}"}) + "\n"
                               for i, length in enumerate(lengths)))
    config = SweepConfig(targets=(str(model),), drafters=("ngram",), ks=(1, 2), methods=("sps",),
                         datasets=(str(prompts),), limit=5, max_new_tokens=12, warmup=1, baseline_every=2,
                         host_baselines=False, race_after=2, budget_s=0.01, preflight_s=0)
    store = ResultsStore(tmp_path / "s.sqlite")
    run_sweep(config, store, progress=False)
    plan_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("plan: "))
    assert "4 of 5 prompts x 1 cells" in plan_line and "over the" in plan_line  # 10 ms hold none: cells go first
    assert "cell(s) left out" in plan_line and store.get_meta("plan:" + str(prompts) + ":0") == "4"
    assert f"{model}: a prompt token's prefill" in plan_line and "on the longest prompt (" in plan_line
    skips = store.skips()  # the two sps cells: the pilot's drop where one decoded 3x slower, the plan's the rest
    assert {s["cell"] for s in skips} == {c for c in {s["cell"] for s in skips} if "|sps|" in c} and len(
        {s["cell"] for s in skips}) == 2 and all(s["reason"].startswith((PILOT_REASON, PLAN_REASON)) for s in skips)
    ran = {r["prompt_id"] for r in store.rows()}
    assert {r["method"] for r in store.rows()} == {"ar"} and 1 <= len(ran) <= 4  # the deadline may end it sooner
    for _ in range(4):  # each later run resumes within the stored plan, never past it
        run_sweep(config, store, progress=False)
    assert len({r["prompt_id"] for r in store.rows()}) == 4 and run_sweep(config, store, progress=False) == 0
    prefill_s = {r["prompt_id"]: r["seconds"] for r in store.prefills()}  # timed anew, not left by the longest's pilot
    assert prefill_s["q4"] > 0.5 * prefill_s["q0"]
    store.close()

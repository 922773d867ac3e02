"""Does the study's race give the full grid's answer? How often, and at what regret?

Runs the quick preset (or another) on this host as `./run.sh` does (its budget: the pilot, the plan and the race)
and as the full grid (`--race-after 0 --budget 0`: every cell on every prompt), alternately, `--repeats` times each,
every run its own `draftlab study` process and database. For each budgeted run it prints its answer (what the
study's "Use" line names: a lossless configuration on any engine, or plain decoding on the engine it judges
against), the full grid's, whether they are the same configuration or the full grid cannot tell them apart (the
pick's speedup lies within the answer's paired interval there, or the pick's interval reaches the answer), and the
regret: the full grid's answer's speedup over the pick's, both measured in the full grid against its reference
plain decoding (`draftlab.study.answer.host`). It also replays the race rule on each full grid's own records (the same
decisions the sweep makes, prompt by prompt in the race's order, readmissions included), which isolates the rule
from run-to-run noise. The last line
of stdout is one JSON document. Run it alone: it is a benchmark.

    python benchmarks/race_regret.py --repeats 3
    python benchmarks/race_regret.py --repeats 3 --grids 1              # three races against one full grid
    python benchmarks/race_regret.py --repeats 1 --extra --limit 4      # a smaller grid
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from draftlab.backends.routes import cpu_flags
from draftlab.contenders.methods import method_of
from draftlab.study.run.race import PromptSet, RaceRule, dropped_cells, race_order
from draftlab.study.answer.recommend import chosen
from draftlab.study.answer.report import ALL, CellSummary, load_checks, load_study, pace, summarize
from draftlab.study.run.store import ResultsStore
from draftlab.study.run.sweep import make_config, plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="quick")
    parser.add_argument("--repeats", type=int, default=3, help="race runs and full-grid runs, alternately")
    parser.add_argument("--grids", type=int, help="full grids (default: --repeats); the race runs after the last one "
                                                  "compare with it")
    parser.add_argument("--out", default="results/race-regret", help="a folder per run under it")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `draftlab study` arguments")
    args = parser.parse_args()
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))))
    print(f"host CPU flags: {flags}")
    runs, grids = [], args.repeats if args.grids is None else max(1, args.grids)
    for repeat in range(args.repeats):
        if repeat < grids:
            full = study(Path(args.out) / f"full-{repeat}", args.preset, ["--race-after", "0", "--budget", "0",
                                                                          *args.extra])
        raced = study(Path(args.out) / f"race-{repeat}", args.preset, args.extra)
        runs.append(compare(raced, full, repeat, args.preset))
    same = sum(r["same_or_within_interval"] for r in runs)
    regrets = [r["regret"] for r in runs]
    replayed = [r["replay_regret"] for r in runs]
    print(f"race vs full grid: {same}/{len(runs)} answers the same or within the full grid's interval; regret "
          f"mean {statistics.fmean(regrets):.3f}, worst {max(regrets):.3f}; replayed on the full grids' records: "
          f"worst {max(replayed):.3f}; race runs took {statistics.fmean(r['race_s'] for r in runs):.0f} s, full "
          f"grids {statistics.fmean(r['full_s'] for r in runs):.0f} s on average")
    print(json.dumps({"host_flags": flags, "preset": args.preset, "runs": runs, "same_or_within_interval": same,
                      "regret_mean": statistics.fmean(regrets), "regret_max": max(regrets),
                      "replay_regret_max": max(replayed)}))


def study(out: Path, preset: str, extra: list[str]) -> dict:
    """One `draftlab study` process; its database and wall seconds."""
    started = time.perf_counter()
    command = [sys.executable, "-m", "draftlab.cli", "study", "--preset", preset, "--out", str(out), "--no-progress",
               *extra]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return {"db": out / "study.sqlite", "seconds": time.perf_counter() - started, "extra": extra}


def answers(db: Path) -> dict[tuple, CellSummary]:
    """(configuration -> its summary over the prompt set) of the lossless cells that ran every prompt, the one the
    study's Use line names under the key 'answer'."""
    rows, _, _ = load_study(db)
    summaries = summarize(rows, load_checks(db))
    out = {key(s): s for s in summaries if s.dataset == ALL and s.complete and pace(s) > 0 and not s.lossy
           and method_of(s.method).lossless}
    picks = [s for (_, temperature), s in chosen(summaries).items() if temperature == 0]
    if picks:
        out["answer"] = picks[0]
    return out


def key(s: CellSummary) -> tuple:
    return (s.target, s.method, s.drafter, s.k)


def compare(raced: dict, full: dict, repeat: int, preset: str) -> dict:
    """The race's answer against the full grid's, both as measured in the full grid: the regret is the full grid's
    answer's speedup over the pick's (each over the full grid's reference plain decoding, paired per prompt)."""
    race_cells, full_cells = answers(raced["db"]), answers(full["db"])
    pick, best = key(race_cells["answer"]), full_cells["answer"]
    measured = full_cells.get(pick)
    regret = best.host_speedup / measured.host_speedup if measured else float("inf")
    replay = replay_race(full["db"], preset)
    replay_regret = best.host_speedup / full_cells[replay].host_speedup if replay in full_cells else float("inf")
    within = pick == key(best) or (measured is not None and (measured.host_speedup >= best.host_low
                                                             or measured.host_high >= best.host_speedup))
    row = {"repeat": repeat, "race_pick": " ".join(map(str, pick)), "full_best": " ".join(map(str, key(best))),
           "same_or_within_interval": within, "regret": regret,
           "full_interval": [best.host_low, best.host_high], "full_pick_speedup": measured.host_speedup if measured else None,
           "replay_pick": " ".join(map(str, replay)), "replay_regret": replay_regret,
           "race_s": raced["seconds"], "full_s": full["seconds"]}
    print(f"run {repeat}: race {row['race_pick']} / full grid {row['full_best']}: regret {regret:.3f} (the full "
          f"grid's answer {best.host_speedup:.3f}x ({best.host_low:.3f}-{best.host_high:.3f}) its reference plain "
          f"decoding, the pick {row['full_pick_speedup'] or 0:.3f}x there); the rule replayed on the full grid's "
          f"records picks {row['replay_pick']} (regret {replay_regret:.3f}); {raced['seconds']:.0f} s vs "
          f"{full['seconds']:.0f} s")
    return row


def replay_race(db: Path, preset: str) -> tuple:
    """The race rule applied to a full grid's records as the sweep applies it: prompts in the race's order, cells
    dropped and readmitted before each prompt from the N-th on and once at the end; the pick among the survivors."""
    from draftlab.api import prompt_ids
    from draftlab.models import load_model

    config = make_config(preset)
    store = ResultsStore(db, read_only=True)
    rows = [r for r in store.rows() if (r.get("concurrency") or 1) == 1]
    store.close()
    group = plan(config)[0]
    tokenizer = load_model(config.targets[0], dtype="fp32").tokenizer
    lengths = {p.id: len(prompt_ids(tokenizer, p)) for p in group.prompts}
    order = race_order([p.id for p in group.prompts], lengths, {p.id: p.category for p in group.prompts})
    cells = {c.key: c for name in group.cells for c in group.cells[name]}
    prompts = PromptSet({name: lengths for name in group.cells})
    by_cell = defaultdict(dict)
    for r in rows:
        by_cell[r["cell"]][r["prompt_id"]] = r
    ran = {cell: set(order[: config.race_after]) for cell in by_cell if cell in cells}
    dropped: set[str] = set()
    rule = RaceRule(config.race_after)
    for index in range(config.race_after, len(order) + 1):
        seen = [by_cell[c][p] for c in ran for p in ran[c] if p in by_cell[c]]
        decided = set(dropped_cells([cells[k] for k in ran], seen, rule, prompts))
        for cell in dropped - decided:  # readmitted: catches up
            ran[cell] |= set(order[:index])
        dropped = (dropped & decided) | (decided - dropped if index < len(order) else set())
        if index < len(order):
            for cell in ran:
                if cell not in dropped:
                    ran[cell].add(order[index])
    complete = {cell for cell in ran if cell not in dropped}
    checks = load_checks(db)
    summaries = summarize([by_cell[c][p] for c in complete for p in by_cell[c]], checks)
    return key(next(s for (_, temperature), s in chosen(summaries).items() if temperature == 0))


if __name__ == "__main__":
    main()

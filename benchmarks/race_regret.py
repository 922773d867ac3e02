"""Does the study's race give the full grid's answer? How often, and at what regret?

Runs the quick preset (or another) on this host as `./run.sh` does (its budget: the pilot, the plan and the race)
and as the full grid (`--race-after 0 --budget 0`: every cell on every prompt), alternately, `--repeats` times each,
every run its own `draftlab study` process and database. For each budgeted run it prints its answer (the lossless
cell that decodes fastest over the prompt set, on any engine, as the study's "Use" line ranks them), the full
grid's, whether they are the same configuration or the pick's decode rate in the full grid lies within the full
grid's paired interval of its best, and the regret: the full grid's best decode tok/s over the decode tok/s the full
grid measured for the pick. It also replays the race rule on each full grid's own records (the same decisions the sweep makes, prompt by
prompt in the race's order, readmissions included), which isolates the rule from run-to-run noise. The last line
of stdout is one JSON document. Run it alone: it is a benchmark.

    python benchmarks/race_regret.py --repeats 3
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
from draftlab.study.race import PromptSet, RaceRule, dropped_cells, race_order
from draftlab.study.report import ALL, load_checks, load_study, pace, summarize
from draftlab.study.store import ResultsStore
from draftlab.study.sweep import make_config, plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="quick")
    parser.add_argument("--repeats", type=int, default=3, help="race runs and full-grid runs, alternately")
    parser.add_argument("--out", default="results/race-regret", help="a folder per run under it")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `draftlab study` arguments")
    args = parser.parse_args()
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))))
    print(f"host CPU flags: {flags}")
    runs = []
    for repeat in range(args.repeats):
        full = study(Path(args.out) / f"full-{repeat}", args.preset, ["--race-after", "0", "--budget", "0", *args.extra])
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


def speeds(db: Path) -> tuple[dict[tuple, float], dict[tuple, float]]:
    """(configuration -> decode tok/s over the prompt set) of the lossless cells that ran every prompt, and each
    one's relative half-width (the low end of its paired interval over its speedup)."""
    rows, _, _ = load_study(db)
    summaries = [s for s in summarize(rows, load_checks(db)) if s.dataset == ALL and s.complete and pace(s) > 0
                 and not s.lossy and method_of(s.method).lossless]
    key = lambda s: (s.target, s.method, s.drafter, s.k)  # noqa: E731
    return ({key(s): pace(s) for s in summaries},
            {key(s): s.speedup_low / s.speedup if s.speedup else 1.0 for s in summaries})


def compare(raced: dict, full: dict, repeat: int, preset: str) -> dict:
    """The race's pick against the full grid's, measured in the full grid."""
    race_speed, _ = speeds(raced["db"])
    full_speed, low = speeds(full["db"])
    pick, best = max(race_speed, key=race_speed.get), max(full_speed, key=full_speed.get)
    regret = full_speed[best] / full_speed[pick] if pick in full_speed else float("inf")
    replay = replay_race(full["db"], preset)
    replay_regret = full_speed[best] / full_speed[replay] if replay in full_speed else float("inf")
    within = pick == best or (pick in full_speed and full_speed[pick] >= full_speed[best] * low[best])
    row = {"repeat": repeat, "race_pick": " ".join(map(str, pick)), "full_best": " ".join(map(str, best)),
           "same_or_within_interval": within, "regret": regret, "full_interval_low": low[best],
           "replay_pick": " ".join(map(str, replay)), "replay_regret": replay_regret,
           "race_s": raced["seconds"], "full_s": full["seconds"]}
    print(f"run {repeat}: race {row['race_pick']} / full grid {row['full_best']}: regret {regret:.3f} (the full "
          f"grid's interval reaches {low[best]:.3f}x its best); the rule replayed on the full grid's records picks {row['replay_pick']} "
          f"(regret {replay_regret:.3f}); {raced['seconds']:.0f} s vs {full['seconds']:.0f} s")
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
    ran = {key: set(order[: config.race_after]) for key in by_cell if key in cells}
    dropped: set[str] = set()
    rule = RaceRule(config.race_after)
    for index in range(config.race_after, len(order) + 1):
        seen = [by_cell[key][p] for key in ran for p in ran[key] if p in by_cell[key]]
        decided = set(dropped_cells([cells[k] for k in ran], seen, rule, prompts))
        for key in dropped - decided:  # readmitted: catches up
            ran[key] |= set(order[:index])
        dropped = (dropped & decided) | (decided - dropped if index < len(order) else set())
        if index < len(order):
            for key in ran:
                if key not in dropped:
                    ran[key].add(order[index])
    complete = {key for key in ran if key not in dropped}
    summaries = [s for s in summarize([by_cell[k][p] for k in complete for p in by_cell[k]], [])
                 if s.dataset == ALL and s.complete and not s.lossy and method_of(s.method).lossless]
    best = max(summaries, key=pace)
    return (best.target, best.method, best.drafter, best.k)


if __name__ == "__main__":
    main()

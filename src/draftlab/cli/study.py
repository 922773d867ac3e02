"""`draftlab sweep | study | report | export`: the study's commands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftlab.cli.options import add_preflight_arg
from draftlab.errors import DraftlabError
from draftlab.deploy import EXPORT_ENGINES


def add_study_commands(sub) -> None:
    """Register the study subcommands on the top-level subparsers."""
    sweep = sub.add_parser("sweep", help="run a grid of target x draft x K x method x dataset into a study database")
    _add_sweep_args(sweep)
    sweep.set_defaults(run=cmd_sweep)
    study = sub.add_parser("study", help="sweep, then write the report (the quick study by default)")
    _add_sweep_args(study, db_required=False)
    study.add_argument("--out", default="results/quick", help="folder for study.sqlite and the report")
    study.add_argument("--output-tokens", type=int, metavar="N", help="state end-to-end times for N-token outputs "
                       "(each engine's prefill plus N tokens at the decode rate measured; default: the study's)")
    study.set_defaults(run=cmd_study)
    report = sub.add_parser("report", help="HTML report with tables and plots from a study database")
    report.add_argument("--db", required=True)
    report.add_argument("--out", required=True, help="output folder")
    report.add_argument("--profile", help="calibration profile: adds the performance model's check and what-ifs")
    report.add_argument("--microbench", help="microbench.json of `draftlab design microbench`: depth vs width beside the seeds")
    report.add_argument("--correlate", help="correlate.json of `draftlab design correlate`: accuracy vs TAR beside the seeds")
    report.add_argument("--output-tokens", type=int, metavar="N", help="state end-to-end times for N-token "
                        "outputs (each engine's prefill plus N tokens at the decode rate measured)")
    report.add_argument("--export", nargs="+", choices=EXPORT_ENGINES, default=[], metavar="ENGINE",
                        help="also print the configuration to deploy as a command for vllm, sglang or llama-server "
                             "(with vLLM's K per batch size where the study measured several concurrency levels)")
    report.set_defaults(run=cmd_report)
    export = sub.add_parser("export", help="export a study's records as CSV or JSONL")
    export.add_argument("--db", required=True)
    export.add_argument("--out", required=True, help="file to write; the format follows its suffix (.csv, .jsonl)")
    export.set_defaults(run=cmd_export)


def _add_sweep_args(parser: argparse.ArgumentParser, db_required: bool = True) -> None:
    parser.add_argument("--db", required=db_required, help="study database (SQLite); resumes if it exists")
    parser.add_argument("--preset", default="quick", help="quick (the main job: minutes on 2 CPU cores; torch and llama.cpp), full, or family "
                                                          "(the seeds' study on the Qwen2.5-Coder pair on llama.cpp, with its calibration and "
                                                          "microbenchmark: about an hour on 2 CPU cores)")
    parser.add_argument("--config", help="TOML file with the grid (keys as the flags, in a [sweep] table)")
    parser.add_argument("--targets", nargs="+")
    parser.add_argument("--drafters", nargs="+")
    parser.add_argument("--ks", help="K values: 1-7 or 1,2,4")
    parser.add_argument("--methods", nargs="+", help="sps asg hf lcp llama vllm (ar always runs; hf, HF's own plain "
                        "decoding, runs with asg; llama, llama-cpp-python's, with lcp, its prompt lookup; vllm, "
                        "vLLM's own speculation with each drafter it has, and its plain decoding, at each "
                        "--concurrency; its environment is made first where it is missing)")
    parser.add_argument("--datasets", nargs="+", help="bundled prompt sets or JSONL prompt files")
    parser.add_argument("--prompts", help="your own workload: a JSONL file (draftlab lines or MT-Bench/Spec-Bench "
                                          "questions); added to --datasets")
    parser.add_argument("--temperatures", nargs="+", type=float)
    parser.add_argument("--limit", type=int, help="prompts per dataset")
    parser.add_argument("--skip", type=int, help="prompts passed over first (round-robin order)")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--baseline-every", type=int,
                        help="re-time the baseline after this many cells of a prompt (0: never; default 6)")
    parser.add_argument("--race-after", type=int, metavar="N",
                        help="after N prompts of a dataset, stop measuring cells that trail the fastest one by more "
                             "than the machine's noise (0: run the whole grid; quick: 2)")
    parser.add_argument("--budget", type=_duration, metavar="TIME", dest="study_budget",
                        help="the study's time budget, as 8m, 90s or seconds: it times the host first, plans the "
                             "prompts to fit and prints its plan (0: none, every prompt; quick: 8m)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--device")
    parser.add_argument("--dtype")
    parser.add_argument("--backend", help="auto | fast | hf | llamacpp (or name a target llamacpp:NAME)")
    parser.add_argument("--no-host-baselines", action="store_true",
                        help="do not time plain decoding in the host's other dtypes and routes ('plain' cells)")
    parser.add_argument("--adapt", nargs="?", const="", default=None, metavar="OPTIONS",
                        help="add an adapting twin (adapt[:OPTIONS]/SPEC) of every feature or heads draft among the "
                             "drafters: it learns over its cell's prompts, in order")
    parser.add_argument("--servers", nargs="+", metavar="TYPE[/DRAFT][:K,...[:P,...]]",
                        help="llama-server's own speculative types, raced on every GGUF target beside its plain "
                             "decoding: ngram-mod, ngram-simple:16,64, draft-simple/qwen2.5-coder-0.5b:3,4 (K: the "
                             "type's draft length flag; none: the study's --ks; 0: the server's default)")
    parser.add_argument("--concurrency", help="requests in flight for the served cells (llama-server, vLLM): 1,2,4 "
                                              "(each level its own servers with that many slots; default 1)")
    parser.add_argument("--weight-types", nargs="+", metavar="TYPE",
                        help="also run every llama.cpp target in these weight types (BF16, Q8_0, ...), derived with "
                             "llama.cpp's quantizer")
    add_preflight_arg(parser)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-progress", action="store_true")


def _duration(text: str) -> float:
    """'8m', '90s' or '480' -> seconds (argparse's type: a bad value is refused in one line)."""
    scale = {"m": 60.0, "s": 1.0}.get(text[-1:].lower(), 1.0)
    try:
        seconds = float(text[:-1] if text[-1:].lower() in "ms" else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time: {text!r} (give 8m, 90s or seconds)") from None
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"the budget must be >= 0, got {text!r}")
    return seconds


def _sweep_config(args):
    from dataclasses import replace

    from draftlab.api import parse_layers
    from draftlab.registry import with_adapting
    from draftlab.study.run.config import with_weight_types
    from draftlab.study.run.sweep import make_config

    ks = tuple(parse_layers(args.ks)) if args.ks else None
    concurrency = tuple(parse_layers(args.concurrency)) if args.concurrency else None
    tuple_or_none = lambda v: tuple(v) if v else None  # noqa: E731
    config = make_config(
        args.preset, args.config, targets=tuple_or_none(args.targets), drafters=tuple_or_none(args.drafters), ks=ks,
        methods=tuple_or_none(args.methods), datasets=tuple_or_none([*(args.datasets or []), *([args.prompts] if args.prompts else [])]),
        temperatures=tuple_or_none(args.temperatures), limit=args.limit, skip=args.skip, max_new_tokens=args.max_new_tokens,
        warmup=args.warmup, baseline_every=args.baseline_every, race_after=args.race_after, seed=args.seed, device=args.device, dtype=args.dtype,
        backend=args.backend, host_baselines=False if args.no_host_baselines else None,
        servers=tuple_or_none(args.servers), concurrency=concurrency, preflight_s=args.preflight_timeout,
        budget_s=args.study_budget,
    )
    config = with_weight_types(config, tuple(args.weight_types or ()))
    return replace(config, drafters=with_adapting(config.drafters, args.adapt))


def _run_sweep(args, db):
    """Run (or resume) the sweep of the arguments into `db`; its configuration."""
    from draftlab.study.run.store import ResultsStore
    from draftlab.study.run.sweep import plan, run_sweep

    config = _sweep_config(args)
    groups = plan(config)  # a bad prompt set is refused before the database is created
    store = ResultsStore(db)
    try:
        added = run_sweep(config, store, progress=not args.no_progress, groups=groups)
    finally:
        store.close()
    print(f"sweep: {added} new records in {db}" if added else f"sweep: nothing to do, {db} is complete")
    return config


def cmd_sweep(args) -> None:
    """Run (or resume) a sweep into --db."""
    _run_sweep(args, args.db)


def cmd_study(args) -> None:
    """Sweep into OUT/study.sqlite, make what the preset's seed findings need (OUT/profile.json, ...), write
    OUT/report, print the answer's sections."""
    from draftlab.study.answer.results import ReportInputs
    from draftlab.study.run.seed_inputs import make_seed_inputs

    out = Path(args.out)
    db = args.db or str(out / "study.sqlite")
    config = _run_sweep(args, db)
    seeds = make_seed_inputs(config, out, progress=not args.no_progress)
    _report(db, out / "report", ReportInputs(seeds.profile, seeds.microbench, output_tokens=args.output_tokens))


def cmd_report(args) -> None:
    """Write the HTML report of a study database; print the same sections."""
    from draftlab.study.answer.results import ReportInputs

    optional = lambda path: Path(path) if path else None  # noqa: E731
    _report(args.db, Path(args.out), ReportInputs(optional(args.profile), optional(args.microbench),
                                                  optional(args.correlate), args.output_tokens, tuple(args.export)))


def _report(db, out: Path, inputs) -> None:
    """Load the study once, write its page, and print the page's sections in the same order."""
    from draftlab.study.answer.page import write_report
    from draftlab.study.answer.results import StudyResults
    from draftlab.study.answer.sections import sections_of, terminal_lines

    results = StudyResults.load(db, inputs, figures_dir=out)
    sections = sections_of(results)
    print(f"report: {write_report(results, sections, out)}")
    print("\n".join(terminal_lines(sections)))


def cmd_export(args) -> None:
    """Write a study's records as CSV or JSONL."""
    from draftlab.study.answer.report import load_study, write_csv

    rows, _, _ = load_study(args.db)
    out = Path(args.out)
    if out.suffix == ".csv":
        write_csv(out, [{**r, "accepted_per_step": json.dumps(r["accepted_per_step"]),
                         "drafted_per_step": json.dumps(r["drafted_per_step"])} for r in rows])
    elif out.suffix == ".jsonl":
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        raise DraftlabError(f"cannot tell the format of {out}: use a .csv or .jsonl file name")
    print(f"export: {len(rows)} records to {out}")



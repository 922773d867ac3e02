"""The `draftlab` command line: generate, bench, sweep, study, report, export.

Errors in the input print one line that says what to do and exit with 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from draftlab.cli_design import add_design_commands
from draftlab.errors import DraftlabError
from draftlab.models import DEFAULT_TARGET


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET, help="short name, .gguf file or HF model directory")
    parser.add_argument("--drafter", default="ngram", help="none | ngram[:N|:A-B] | layers:0-3 | model:NAME_OR_PATH")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step (>= 1)")
    parser.add_argument("--dynamic-k", action="store_true", help="grow K after full acceptance, shrink after a rejection")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), fp32, bf16, fp16")
    parser.add_argument("--backend", default="auto", help="auto | fast (draftlab's Llama forward) | hf (transformers)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="end stdout with one JSON object")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="draftlab", description="Lossless speculative decoding and its evidence.")
    sub = parser.add_subparsers(dest="command", required=True)
    generate = sub.add_parser("generate", help="generate text with speculative decoding")
    _add_model_args(generate)
    generate.add_argument("--prompt", required=True, help="prompt text, or - to read it from stdin")
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    generate.set_defaults(run=cmd_generate)
    bench = sub.add_parser("bench", help="speculative vs autoregressive on the same prompts")
    _add_model_args(bench)
    source = bench.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", help="mixed, mt-bench, humaneval, xsum, mmlu, hellaswag, math")
    source.add_argument("--prompts", help="JSONL file with a 'prompt' per line")
    bench.add_argument("--limit", type=int, default=8, help="prompts to run, spread over categories")
    bench.add_argument("--warmup", type=int, default=1)
    bench.set_defaults(run=cmd_bench)
    sweep = sub.add_parser("sweep", help="run a grid of target x draft x K x method x dataset into a study database")
    _add_sweep_args(sweep)
    sweep.set_defaults(run=cmd_sweep)
    study = sub.add_parser("study", help="sweep, then write the report (the quick study by default)")
    _add_sweep_args(study, db_required=False)
    study.add_argument("--out", default="results/quick", help="folder for study.sqlite and the report")
    study.set_defaults(run=cmd_study)
    report = sub.add_parser("report", help="HTML report with tables and plots from a study database")
    report.add_argument("--db", required=True)
    report.add_argument("--out", required=True, help="output folder")
    report.add_argument("--profile", help="calibration profile: adds the performance model's check and what-ifs")
    report.set_defaults(run=cmd_report)
    export = sub.add_parser("export", help="export a study's records as CSV or JSONL")
    export.add_argument("--db", required=True)
    export.add_argument("--out", required=True, help="file to write; the format follows its suffix (.csv, .jsonl)")
    export.set_defaults(run=cmd_export)
    calibrate = sub.add_parser("calibrate", help="measure target block times, draft costs and acceptance")
    _add_tune_args(calibrate)
    calibrate.add_argument("--out", required=True, help="profile JSON to write")
    calibrate.set_defaults(run=cmd_calibrate)
    predict = sub.add_parser("predict", help="predicted tokens/s and speedup per draft and K from a profile")
    predict.add_argument("--profile", required=True)
    predict.add_argument("--goal", type=float, help="also print the TAR each draft needs for this tokens/s")
    predict.set_defaults(run=cmd_predict)
    validate = sub.add_parser("validate", help="compare the model's predictions with a measured study")
    validate.add_argument("--profile", required=True)
    validate.add_argument("--db", required=True)
    validate.add_argument("--out", help="folder for the predicted-vs-measured plot and CSV")
    validate.set_defaults(run=cmd_validate)
    tune = sub.add_parser("tune", help="calibrate, predict, pick draft and K, confirm, print how to use it")
    _add_tune_args(tune)
    tune.add_argument("--budget", type=float, default=None, help="seconds; skip the confirmation run if exceeded")
    tune.set_defaults(run=cmd_tune)
    add_design_commands(sub)
    return parser


def _add_tune_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--drafts", nargs="+", default=None,
                        help="candidate drafter specs (default: ngram, ngram:2-4, layers:0-3, layers:0-7)")
    parser.add_argument("--dataset", default="mixed")
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--k-max", type=int, default=7)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-progress", action="store_true")


DEFAULT_DRAFTS = ["ngram", "ngram:2-4", "layers:0-3", "layers:0-7"]


def _calibration_inputs(args):
    from draftlab.calibrate import CalibrationSettings
    from draftlab.datasets import load_prompts
    from draftlab.models import load_model

    settings = CalibrationSettings(args.k_max, args.max_new_tokens, args.repeats, args.backend)
    if settings.k_max < 1:
        raise DraftlabError(f"--k-max must be >= 1, got {settings.k_max}")
    prompts = load_prompts(args.dataset, args.limit)
    target = load_model(args.target, device=args.device, dtype=args.dtype)
    target.name = args.target
    return target, args.drafts or DEFAULT_DRAFTS, prompts, settings


def cmd_calibrate(args) -> None:
    """Measure and save a profile."""
    from draftlab.calibrate import calibrate

    target, drafts, prompts, settings = _calibration_inputs(args)
    profile = calibrate(target, drafts, prompts, settings, progress=not args.no_progress)
    profile.save(args.out)
    print(f"calibrate: profile of {len(drafts)} drafts in {profile.seconds:.0f}s -> {args.out}")


def cmd_predict(args) -> None:
    """Print both formulas' predictions from a profile."""
    from draftlab.calibrate import Profile
    from draftlab.tuner import format_predictions, format_what_if, predictions, required_tar

    profile = Profile.load(args.profile)
    preds = predictions(profile)
    print(format_predictions(preds, profile.target.autoregressive_tokens_per_s))
    print(format_what_if(preds))
    if args.goal:
        print(f"TAR needed for {args.goal:.1f} tokens/s:")
        for p in preds:
            print(f"  {p.draft:<18} K={p.k}: {required_tar(args.goal, p.t_target, p.t_draft):.2f}")


def cmd_validate(args) -> None:
    """Errors of both formulas against a measured study."""
    from pathlib import Path

    from draftlab.calibrate import Profile
    from draftlab.study.report import load_study, write_csv
    from draftlab.tuner import compare, error_summary, plot_comparison

    rows, _, _ = load_study(args.db)
    comparisons = compare(Profile.load(args.profile), rows)
    print(f"{'draft':<18}{'K':>3}{'measured':>10}{'simplified':>12}{'err':>7}{'Leviathan':>11}{'err':>7}")
    for c in comparisons:
        print(f"{c.draft:<18}{c.k:>3}{c.measured_tokens_per_s:>10.1f}{c.simplified_tokens_per_s:>12.1f}"
              f"{c.simplified_error:>7.1%}{c.leviathan_tokens_per_s:>11.1f}{c.leviathan_error:>7.1%}")
    summary = error_summary(comparisons)
    print(f"simplified model: mean error {summary['simplified_mean_error']:.1%}, max {summary['simplified_max_error']:.1%}; "
          f"Leviathan: mean {summary['leviathan_mean_error']:.1%}, max {summary['leviathan_max_error']:.1%} "
          f"({summary['cells']} cells, decode throughput, prefill excluded)")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        plot_comparison(comparisons, out / "predicted_vs_measured.png")
        write_csv(out / "predicted_vs_measured.csv", [
            {"draft": c.draft, "k": c.k, "measured": c.measured_tokens_per_s, "simplified": c.simplified_tokens_per_s,
             "leviathan": c.leviathan_tokens_per_s} for c in comparisons])
    print(json.dumps(summary))


def cmd_tune(args) -> None:
    """Recommend a draft and K, with predicted and measured speed and how to use it."""
    from draftlab.tuner import format_predictions, tune, usage

    target, drafts, prompts, settings = _calibration_inputs(args)
    rec, profile, preds = tune(target, drafts, prompts, settings, confirm=True, progress=not args.no_progress)
    print(format_predictions(preds, profile.target.autoregressive_tokens_per_s))
    measured = (f"measured {rec.measured_tokens_per_s:.1f} tokens/s ({rec.measured_speedup:.2f}x)"
                if rec.measured_tokens_per_s else "not measured")
    print(f"\nrecommendation: drafter={rec.draft} K={rec.k}: predicted {rec.predicted_tokens_per_s:.1f} tokens/s "
          f"({rec.predicted_speedup:.2f}x), {measured}; tuning took {rec.seconds:.0f}s")
    if args.budget and rec.seconds > args.budget:
        print(f"note: tuning took {rec.seconds:.0f}s, over the budget of {args.budget:.0f}s; lower --limit or --repeats")
    for line in usage(args.target, rec.draft, rec.k):
        print("  " + line)
    print(json.dumps({"draft": rec.draft, "k": rec.k, "predicted_tokens_per_s": rec.predicted_tokens_per_s,
                      "predicted_speedup": rec.predicted_speedup, "measured_tokens_per_s": rec.measured_tokens_per_s,
                      "measured_speedup": rec.measured_speedup, "seconds": rec.seconds}))


def _add_sweep_args(parser: argparse.ArgumentParser, db_required: bool = True) -> None:
    parser.add_argument("--db", required=db_required, help="study database (SQLite); resumes if it exists")
    parser.add_argument("--preset", default="quick", help="quick (a few minutes on a CPU) or full")
    parser.add_argument("--config", help="TOML file with the grid (keys as the flags, in a [sweep] table)")
    parser.add_argument("--targets", nargs="+")
    parser.add_argument("--drafters", nargs="+")
    parser.add_argument("--ks", help="K values: 1-7 or 1,2,4")
    parser.add_argument("--methods", nargs="+", help="sps asg (ar always runs)")
    parser.add_argument("--datasets", nargs="+")
    parser.add_argument("--temperatures", nargs="+", type=float)
    parser.add_argument("--limit", type=int, help="prompts per dataset")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--device")
    parser.add_argument("--dtype")
    parser.add_argument("--backend")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-progress", action="store_true")


def _decoder(args):
    from draftlab.api import SpeculativeDecoder

    return SpeculativeDecoder.from_names(
        args.target, drafter=args.drafter, k=args.k, dynamic_k=args.dynamic_k, device=args.device, dtype=args.dtype,
        backend=args.backend,
    )


def _check_args(args) -> None:
    from draftlab.policy import FixedK
    from draftlab.sampling import SamplingConfig

    if args.command not in ("generate", "bench"):
        return
    FixedK(args.k)
    SamplingConfig(args.temperature, args.top_k, args.top_p)
    if args.max_new_tokens < 1:
        raise DraftlabError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")


def cmd_generate(args) -> None:
    """Stream the generated text, then the statistics."""
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    decoder = _decoder(args)
    tokenizer = decoder.target.tokenizer
    new: list[int] = []
    shown = 0

    def stream(kept: list[int]) -> None:
        nonlocal shown
        new.extend(kept)
        text = tokenizer.decode(new, skip_special_tokens=True)
        sys.stdout.write(text[shown:])
        sys.stdout.flush()
        shown = len(text)

    result = decoder.generate(
        prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, stop_strings=args.stop, chat=not args.no_chat, on_tokens=stream,
    )
    sys.stdout.write("\n")
    stats = result.stats.to_dict()
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "target": args.target,
                          "drafter": args.drafter, "k": args.k, **stats}))
        return
    print(
        f"-- {stats['new_tokens']} tokens in {stats['steps']} steps | {stats['tokens_per_step']:.2f} tokens/step | "
        f"acceptance {stats['acceptance_rate']:.1%} | {stats['tokens_per_s']:.1f} tokens/s | "
        f"draft {stats['draft_s']:.2f}s target {stats['target_s'] + stats['prefill_s']:.2f}s "
        f"overhead {stats['overhead_s']:.2f}s wall {stats['wall_s']:.2f}s | stop: {stats['stop_reason']}",
        file=sys.stderr if args.json else sys.stdout,
    )


def cmd_bench(args) -> None:
    """Baseline vs speculative on a prompt set; a table, and JSON with --json."""
    from draftlab.bench import BenchSettings, run_bench
    from draftlab.datasets import load_prompts

    if args.limit is not None and args.limit < 1:
        raise DraftlabError(f"--limit must be >= 1, got {args.limit}")
    prompts = load_prompts(args.dataset or args.prompts, args.limit)
    decoder = _decoder(args)
    settings = BenchSettings(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, args.warmup)
    summary = run_bench(decoder, prompts, settings).summary()
    print(format_bench_table(summary, args))
    if args.json:
        print(json.dumps({"target": args.target, "drafter": args.drafter, "k": args.k,
                          "dtype": str(decoder.target.dtype).removeprefix("torch."), **summary}))


def format_bench_table(summary: dict, args) -> str:
    """A table per category and overall, for people."""
    header = f"{'category':<16}{'prompts':>8}{'AR tok/s':>10}{'SpS tok/s':>11}{'speedup':>9}{'(min-max)':>14}{'TAR':>6}{'accept':>8}{'identical':>11}"
    lines = [f"target={args.target} drafter={args.drafter} k={args.k} temperature={args.temperature}", header]
    rows = [*summary["categories"].items(), ("all", summary)]
    for name, row in rows:
        lines.append(
            f"{name:<16}{row['prompts']:>8}{row['baseline_tokens_per_s']:>10.1f}{row['tokens_per_s']:>11.1f}"
            f"{row['speedup']:>8.2f}x{row['speedup_min']:>7.2f}-{row['speedup_max']:<5.2f}"
            f"{row['tokens_per_step']:>6.2f}{row['acceptance_rate']:>8.1%}{row['identical']:>7}/{row['prompts']}"
        )
    lines.append(
        f"time split (speculative): draft {summary['draft_s']:.1f}s, target {summary['target_s']:.1f}s, "
        f"overhead {summary['overhead_s']:.1f}s of {summary['wall_s']:.1f}s"
    )
    return "\n".join(lines)


def _sweep_config(args):
    from draftlab.api import parse_layers
    from draftlab.study.sweep import make_config

    ks = tuple(parse_layers(args.ks)) if args.ks else None
    tuple_or_none = lambda v: tuple(v) if v else None  # noqa: E731
    return make_config(
        args.preset, args.config, targets=tuple_or_none(args.targets), drafters=tuple_or_none(args.drafters), ks=ks,
        methods=tuple_or_none(args.methods), datasets=tuple_or_none(args.datasets),
        temperatures=tuple_or_none(args.temperatures), limit=args.limit, max_new_tokens=args.max_new_tokens,
        warmup=args.warmup, seed=args.seed, device=args.device, dtype=args.dtype, backend=args.backend,
    )


def _run_sweep(args, db) -> None:
    from draftlab.study.store import ResultsStore
    from draftlab.study.sweep import run_sweep

    config = _sweep_config(args)
    store = ResultsStore(db)
    try:
        added = run_sweep(config, store, progress=not args.no_progress)
    finally:
        store.close()
    print(f"sweep: {added} new records in {db}" if added else f"sweep: nothing to do, {db} is complete")


def cmd_sweep(args) -> None:
    """Run (or resume) a sweep into --db."""
    _run_sweep(args, args.db)


def cmd_study(args) -> None:
    """Sweep into OUT/study.sqlite, write OUT/report, print the optimal table."""
    from pathlib import Path

    from draftlab.study.report import build_report, format_optimal, load_study, optimal_table, summarize

    out = Path(args.out)
    db = args.db or str(out / "study.sqlite")
    _run_sweep(args, db)
    page = build_report(db, out / "report")
    rows, params, _ = load_study(db)
    print(format_optimal(optimal_table(summarize(rows), params)))
    print(f"report: {page}")


def cmd_report(args) -> None:
    """Write the HTML report of a study database."""
    from draftlab.study.report import build_report

    print(f"report: {build_report(args.db, args.out, args.profile)}")


def cmd_export(args) -> None:
    """Write a study's records as CSV or JSONL."""
    from pathlib import Path

    from draftlab.study.report import load_study, write_csv

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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars would bury our own output
    hf_logging.set_verbosity_error()
    try:
        _check_args(args)
        if getattr(args, "threads", None):
            import torch

            torch.set_num_threads(args.threads)
        args.run(args)
    except DraftlabError as exc:
        print(f"draftlab: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("draftlab: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

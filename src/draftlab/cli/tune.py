"""`draftlab calibrate | predict | validate | tune`: the performance model's commands."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from draftlab.backends.engines import engine_of_backend
from draftlab.cli.options import add_preflight_arg
from draftlab.errors import DraftlabError
from draftlab.defaults import DEFAULT_BACKEND
from draftlab.deploy import EXPORT_ENGINES, Deployable, export
from draftlab.models import DEFAULT_TARGET, ModelSpec
from draftlab.perf.calibrate import CalibrationSettings
from draftlab.drafters.kinds import is_adapting


def add_tune_commands(sub) -> None:
    """Register the performance-model subcommands on the top-level subparsers."""
    calibrate = sub.add_parser("calibrate", help="measure target block times, draft costs and acceptance")
    _add_tune_args(calibrate)
    calibrate.add_argument("--out", required=True, help="profile JSON to write")
    calibrate.add_argument("--shape-of", metavar="SHAPE",
                           help="calibrate from a model's shape alone: its block costs 1..16 timed on --device with "
                                "random weights (smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, llama-3-8b, "
                                "or a Llama/Qwen2 config.json or its folder); then `predict --acceptance-from STUDY`")
    calibrate.add_argument("--context", type=int,
                           help="cached tokens before each timed block (match the workload's mean prompt length plus "
                                "half its new tokens; `predict --acceptance-from` says the study's); default: 256 with "
                                "--shape-of, else the calibration prompts' mean length plus half --max-new-tokens")
    calibrate.add_argument("--draft-shape", nargs="+", default=[], metavar="DRAFTER=SHAPE",
                           help="with --shape-of: model drafts whose cost per token is timed from their shape, e.g. "
                                "model:qwen2.5-coder-0.5b=qwen2.5-0.5b (other drafts' costs come from the study)")
    calibrate.add_argument("--json", action="store_true", help="end stdout with the profile as one JSON object")
    calibrate.set_defaults(run=cmd_calibrate)
    predict = sub.add_parser("predict", help="predicted tokens/s and speedup per draft and K from a profile")
    predict.add_argument("--profile", required=True)
    predict.add_argument("--goal", type=float, help="also print the TAR each draft needs for this tokens/s")
    predict.add_argument("--acceptance-from", metavar="STUDY",
                         help="a study database (run on any device): TAR per draft and K from its SpS records on "
                              "the profile's engine (llama.cpp for `calibrate --backend llamacpp`, else torch), the "
                              "target's cost from the profile (`calibrate`, or `calibrate --shape-of`): a predicted "
                              "table for the profile's device, with its error where the study ran there")
    predict.add_argument("--json", action="store_true", help="end stdout with one JSON object")
    predict.set_defaults(run=cmd_predict)
    validate = sub.add_parser("validate", help="compare the model's predictions with a measured study")
    validate.add_argument("--profile", required=True)
    validate.add_argument("--db", required=True)
    validate.add_argument("--out", help="folder for the predicted-vs-measured plot and CSV")
    validate.set_defaults(run=cmd_validate)
    tune = sub.add_parser("tune", help="calibrate, predict, pick draft and K, confirm, print how to use it")
    _add_tune_args(tune)
    tune.add_argument("--budget", type=float, default=None,
                      help="seconds for the whole tune; calibration and the race are sized to fit it")
    tune.add_argument("--dtypes", nargs="+", default=None,
                      help="search the target's dtype too (e.g. fp32 bf16): each is tuned, then the picks race head "
                           "to head; the first is the reference for speedups and output equality (replaces --dtype)")
    tune.add_argument("--servers", nargs="+", metavar="TYPE[/DRAFT][:K,...[:P,...]]",
                      help="with --backend llamacpp: end with a round on llama-server, the pick beside the server's "
                           "plain decoding and these speculative types of its own (ngram-mod, ngram-simple:16, ...), "
                           "and print the llama-server command to deploy")
    tune.add_argument("--export", nargs="+", choices=EXPORT_ENGINES, default=[], metavar="ENGINE",
                      help="also print the pick as a command for vllm, sglang or llama-server (their own syntax)")
    tune.add_argument("--json", action="store_true", help="stdout ends with one JSON object (tune always does)")
    tune.set_defaults(run=cmd_tune)


def _add_tune_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--drafts", nargs="+", default=None,
                        help="candidate drafter specs (default: ngram, ngram:2-4, layers:0-3, layers:0-7)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--dataset", default="mixed", help="a bundled prompt set")
    source.add_argument("--prompts", help="your own workload: a JSONL file (draftlab lines or MT-Bench questions)")
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--k-max", type=int, default=CalibrationSettings.k_max)
    parser.add_argument("--max-new-tokens", type=int, default=CalibrationSettings.max_new_tokens)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=ModelSpec.dtype)
    parser.add_argument("--backend", default=DEFAULT_BACKEND)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-progress", action="store_true")
    add_preflight_arg(parser)


DEFAULT_DRAFTS = ["ngram", "ngram:2-4", "layers:0-3", "layers:0-7"]
LLAMACPP_DRAFTS = ["ngram", "ngram:2-4"]  # untrained layer drafts rarely pay where each is a model of its own


def _calibration_inputs(args):
    """The target (in --dtype), drafts, prompts and calibration settings of a command."""
    drafts, prompts, settings = _search_inputs(args)
    return _load_target(args, args.dtype), drafts, prompts, settings


def _search_inputs(args):
    from draftlab.perf.calibrate import CalibrationSettings
    from draftlab.files.datasets import load_prompts

    settings = CalibrationSettings(args.k_max, args.max_new_tokens, args.repeats, args.backend)
    if settings.k_max < 1:
        raise DraftlabError(f"--k-max must be >= 1, got {settings.k_max}")
    defaults = LLAMACPP_DRAFTS if engine_of_backend(args.backend).runs_gguf else DEFAULT_DRAFTS
    adapting = [d for d in args.drafts or [] if is_adapting(d)]
    if adapting:
        raise DraftlabError(f"{adapting[0]}: calibration and the race time each prompt more than once, and an adapting "
                            "draft would be timed on prompts it learned from; give its static draft here and measure "
                            "adaptation on a stream (draftlab bench --adapt, benchmarks/adapt.py)")
    return args.drafts or defaults, load_prompts(args.prompts or args.dataset, args.limit), settings


def _load_target(args, dtype: str):
    from draftlab.models import load_model

    target = load_model(args.target, device=args.device, dtype=dtype, backend=args.backend)
    target.name = args.target
    return target


def cmd_calibrate(args) -> None:
    """Measure and save a profile."""
    from draftlab.perf.calibrate import calibrate

    if args.shape_of:
        _calibrate_shape(args)
        return
    target, drafts, prompts, settings = _calibration_inputs(args)
    if args.context is not None:
        settings = replace(settings, context=_context(args.context))
    profile = calibrate(target, drafts, prompts, settings, progress=not args.no_progress)
    profile.save(args.out)
    print(f"calibrate: profile of {len(drafts)} drafts in {profile.seconds:.0f}s -> {args.out}; machine drift during "
          f"calibration {profile.target.drift:+.1%}")
    if args.json:
        print(json.dumps(asdict(profile)))


def _calibrate_shape(args) -> None:
    """`calibrate --shape-of`: block costs from random weights in a shape, on --device."""
    from draftlab.checks.exactness import shapes_named
    from draftlab.models import resolve_dtype_name
    from draftlab.perf.shapes import calibrate_shape

    drafts = {drafter: shapes_named([name])[0] for drafter, name in map(_draft_shape, args.draft_shape)}
    dtype = resolve_dtype_name(args.dtype, args.device)
    profile = calibrate_shape(shapes_named([args.shape_of])[0], dtype, args.device, drafts, args.repeats,
                              _context(256 if args.context is None else args.context))
    profile.save(args.out)
    curve = ", ".join(f"{n}: {1000 * s:.2f}" for n, s in sorted(profile.target.score_s.items()) if n in (1, 2, 4, 8, 16))
    trees = ", ".join(f"{n}: {1000 * s:.2f}" for n, s in sorted(profile.target.tree_s.items()) if n in (4, 8, 16))
    print(f"calibrate: {profile.target.name} in {profile.seconds:.0f}s -> {args.out}; block ms {curve}; "
          f"tree ms {trees}")
    if args.json:
        print(json.dumps(asdict(profile)))


def _context(tokens: int) -> int:
    if not 16 <= tokens <= 8192:
        raise DraftlabError(f"--context must be in 16..8192 tokens, got {tokens}")
    return tokens


def _draft_shape(text: str) -> tuple[str, str]:
    drafter, _, shape = text.rpartition("=")
    if not drafter or not shape:
        raise DraftlabError(f"--draft-shape takes DRAFTER=SHAPE (model:qwen2.5-coder-0.5b=qwen2.5-0.5b), got {text!r}")
    return drafter, shape


def _predict_from_study(args, profile) -> None:
    """`predict --acceptance-from`: the profile's device, the study's acceptance."""
    from draftlab.perf.shapes import format_predicted, predict_from
    from draftlab.study.answer.transfer import acceptance_from, mean_context, unlike_study

    cells, plain = acceptance_from(args.acceptance_from, engine_of_backend(profile.backend).runs_gguf)
    context = mean_context(args.acceptance_from)
    unlike = unlike_study(profile, args.acceptance_from, context)
    same = bool(profile.device) and all(c.device == profile.device for c in cells) and not unlike
    rows = predict_from(profile, cells, same_device=same)
    print(format_predicted(rows, profile, plain.get(profile.device) if same else None, context))
    if unlike:
        print(f"  no error figure: {unlike}")
    if args.json:
        print(json.dumps({"profile": profile.target.name, "predicted": [asdict(r) for r in rows]}))


def cmd_predict(args) -> None:
    """Print both formulas' predictions from a profile."""
    from draftlab.perf.calibrate import Profile
    from draftlab.perf.validate import format_predictions, predictions
    from draftlab.perf.present import format_what_if, required_tar

    profile = Profile.load(args.profile)
    if args.acceptance_from:
        _predict_from_study(args, profile)
        return
    preds = predictions(profile)
    print(format_predictions(preds, profile.target.autoregressive_tokens_per_s))
    print(format_what_if(preds))
    if args.goal:
        print(f"TAR needed for {args.goal:.1f} tokens/s:")
        for p in preds:
            print(f"  {p.draft:<18} K={p.k}: {required_tar(args.goal, p.t_target, p.t_draft):.2f}")
    if args.json:
        print(json.dumps({"autoregressive_tokens_per_s": profile.target.autoregressive_tokens_per_s,
                          "predictions": [asdict(p) for p in preds]}))


def cmd_validate(args) -> None:
    """Errors of both formulas against a measured study."""
    from draftlab.perf.calibrate import Profile
    from draftlab.study.answer.report import load_checks, load_study, write_csv
    from draftlab.perf.validate import compare, error_summary
    from draftlab.perf.present import plot_comparison

    rows, _, _ = load_study(args.db)
    comparisons = compare(Profile.load(args.profile), rows)
    print(f"{'draft':<18}{'K':>3}{'measured':>10}{'simplified':>12}{'interval':>15}{'err':>7}{'Leviathan':>11}{'err':>7}"
          "  cause of a large error")
    for c in comparisons:
        interval = f"{c.interval[0]:.1f}-{c.interval[1]:.1f}"
        print(f"{c.draft:<18}{c.k:>3}{c.measured_tokens_per_s:>10.1f}{c.simplified_tokens_per_s:>12.1f}{interval:>15}"
              f"{c.simplified_error:>7.1%}{c.leviathan_tokens_per_s:>11.1f}{c.leviathan_error:>7.1%}  {c.cause}")
    summary = error_summary(comparisons)
    print(f"simplified model: mean error {summary['simplified_mean_error']:.1%}, max {summary['simplified_max_error']:.1%}; "
          f"Leviathan: mean {summary['leviathan_mean_error']:.1%}, max {summary['leviathan_max_error']:.1%} "
          f"({summary['cells']} cells, decode throughput, prefill excluded); measured inside the predicted interval "
          f"in {summary['inside_interval']:.0%} of cells")
    anchored = _anchored_summary(Profile.load(args.profile), rows, load_checks(args.db))
    if anchored:
        print(f"anchored to the study's plain decoding closest in time (a uniform change of the machine's speed "
              f"between calibration and study cancels): simplified mean error {anchored['simplified_mean_error']:.1%}, "
              f"max {anchored['simplified_max_error']:.1%}; inside the interval in {anchored['inside_interval']:.0%} "
              "of cells")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        plot_comparison(comparisons, out / "predicted_vs_measured.png")
        write_csv(out / "predicted_vs_measured.csv", [
            {"draft": c.draft, "k": c.k, "measured": c.measured_tokens_per_s, "simplified": c.simplified_tokens_per_s,
             "leviathan": c.leviathan_tokens_per_s} for c in comparisons])
    print(json.dumps({**summary, "anchored": anchored}))


def _anchored_summary(profile, rows: list[dict], checks: list[dict]) -> dict | None:
    """Errors with predictions anchored to the study's plain decoding; None (said why) when it has none to anchor to."""
    from draftlab.perf.validate import compare, error_summary

    try:
        return error_summary(compare(profile, rows, checks))
    except DraftlabError as exc:
        print(f"anchored errors: not available ({exc})")
        return None


def cmd_tune(args) -> None:
    """Recommend a draft and K (and a dtype, with --dtypes), raced and measured, with how to use it."""
    from draftlab.perf.sizing import TuneSettings
    from draftlab.perf.validate import format_predictions
    from draftlab.perf.tuner import tune
    from draftlab.backends import LLAMA_SERVER
    from draftlab.contenders.preflight import engine_checks, require
    from draftlab.contenders.server_configs import parse_server_spec

    tune_settings = TuneSettings(budget_s=args.budget)
    left_out = require(engine_checks(args.target, args.backend, args.device, (args.dtypes or [args.dtype])[0],
                                     bool(args.servers)), args.preflight_timeout, "tune")
    args.servers = None if LLAMA_SERVER.name in left_out else args.servers  # the server round reads it
    if args.dtypes:
        _tune_dtypes(args, tune_settings)
        return
    target, drafts, prompts, settings = _calibration_inputs(args)
    if args.servers and not target.engine.runs_gguf:
        raise DraftlabError("--servers races llama-server on the target's GGUF: add --backend llamacpp")
    for spec in args.servers or []:  # a bad spec is refused before the tune, not after it
        parse_server_spec(spec)
    rec, profile, preds = tune(target, drafts, prompts, settings, tune_settings, progress=not args.no_progress)
    print(format_predictions(preds, profile.target.autoregressive_tokens_per_s))
    _print_recommendation(args.target, rec)
    served = _server_round(args, target, rec, prompts) if args.servers else None
    exports = print_exports(Deployable(args.target, rec.draft, rec.k), args.export)
    print(json.dumps({**_recommendation_json(rec), **({"llama_server": asdict(served)} if served else {}),
                      **({"exports": exports} if exports else {})}))


def print_exports(choice, engines: list[str]) -> dict[str, str]:
    """Print (and return) the choice as each engine's command, or in one line why that engine has no counterpart."""
    exports = {}
    for engine in engines:
        try:
            exports[engine] = export(choice, engine)
        except DraftlabError as exc:
            exports[engine] = f"not exported: {exc}"
        print(f"{engine}: {exports[engine]}")
    return exports


def _server_round(args, target, rec, prompts):
    """The pick beside llama-server's plain decoding and its own types; prints the round and the command."""
    from draftlab.files.assets import cache_dir
    from draftlab.perf.serve_race import server_round

    served = server_round(target, (rec.draft, rec.k), args.servers, prompts, args.max_new_tokens,
                          cache_dir() / "server-logs", progress=not args.no_progress)
    print("\n".join(served.lines()))
    return served


def _print_recommendation(target: str, rec, dtype: str | None = None) -> None:
    from draftlab.perf.present import usage

    for number, round_ in enumerate(rec.race, start=1):
        ranked = ", ".join(f"{name} {speedup:.2f}x" for name, speedup in
                           sorted(round_["speedups"].items(), key=lambda item: -item[1]))
        print(f"race round {number} ({round_['prompts']} prompt(s), {round_['tokens']} new tokens): {ranked}")
    if rec.measured_tokens_per_s:
        low, high = rec.speedup_spread
        measured = (f"measured {rec.measured_tokens_per_s:.1f} tokens/s ({rec.measured_speedup:.2f}x, per prompt "
                    f"{low:.2f}-{high:.2f}x)")
    else:
        measured = "not measured"
    print(f"\nrecommendation: drafter={rec.draft} K={rec.k}: {measured}; predicted "
          f"{rec.predicted_tokens_per_s:.1f} tokens/s ({rec.predicted_speedup:.2f}x); tuning took {rec.seconds:.0f}s")
    for note in rec.notes:
        print(f"note: {note}")
    for line in usage(target, rec.draft, rec.k):
        print("  " + (line.replace(" --drafter", f" --dtype {dtype} --drafter") if dtype else line))


def _recommendation_json(rec) -> dict:
    return {"draft": rec.draft, "k": rec.k, "predicted_tokens_per_s": rec.predicted_tokens_per_s,
            "predicted_speedup": rec.predicted_speedup, "measured_tokens_per_s": rec.measured_tokens_per_s,
            "measured_speedup": rec.measured_speedup, "speedup_spread": list(rec.speedup_spread),
            "seconds": rec.seconds, "race": list(rec.race), "notes": list(rec.notes)}


def _tune_dtypes(args, tune_settings) -> None:
    """`tune --dtypes ...`: each dtype tuned, the picks raced head to head, the fastest recommended."""
    from draftlab.perf.tuner import tune_dtypes

    drafts, prompts, settings = _search_inputs(args)
    choice = tune_dtypes(lambda dtype: _load_target(args, dtype), args.dtypes, drafts, prompts, settings,
                         tune_settings, progress=not args.no_progress)
    for dtype, rec in choice.per_dtype.items():
        print(f"{dtype}: drafter={rec.draft} K={rec.k}, {rec.measured_speedup or 1.0:.2f}x plain decoding in {dtype}")
    reference = choice.head_to_head[f"{args.dtypes[0]} plain decoding"]
    print("head to head: " + ", ".join(f"{label} {speed:.1f} tok/s ({speed / reference:.2f}x)"
                                       for label, speed in sorted(choice.head_to_head.items(), key=lambda i: -i[1])))
    same, total = choice.identical
    print(f"\nrecommendation: dtype={choice.dtype} drafter={choice.recommendation.draft} K={choice.recommendation.k}: "
          f"{choice.speedup:.2f}x plain decoding in {args.dtypes[0]}; {same}/{total} outputs identical to it; "
          f"tuning took {choice.seconds:.0f}s")
    for note in choice.notes:
        print(f"note: {note}")
    _print_recommendation(args.target, choice.recommendation, choice.dtype)
    print(json.dumps({"dtype": choice.dtype, **_recommendation_json(choice.recommendation),
                      "speedup_over_reference": choice.speedup, "reference_dtype": args.dtypes[0],
                      "identical_to_reference": list(choice.identical), "head_to_head": choice.head_to_head,
                      "per_dtype": {d: _recommendation_json(r) for d, r in choice.per_dtype.items()},
                      "dtype_notes": list(choice.notes), "seconds": choice.seconds}))

"""The `draftlab` command line: generate, bench, sweep, study, report, export, tune, design, audit, serve-check.

Errors in the input print one line that says what to do and exit with 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from draftlab.cli.audit import add_audit_command
from draftlab.cli.check import add_check_commands
from draftlab.cli.arguments import check_args
from draftlab.cli.design import add_design_commands
from draftlab.cli.options import (add_adapt_args, add_drafter_args, add_preflight_arg, add_sampling_args,
                                  add_target_args)
from draftlab.cli.serve import add_serve_commands
from draftlab.cli.study import add_study_commands
from draftlab.cli.tune import add_tune_commands
from draftlab.engine import GenerationConfig
from draftlab.errors import DraftlabError


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    add_target_args(parser)
    add_drafter_args(parser)
    parser.add_argument("--dynamic-k", action="store_true", help="grow K after full acceptance, shrink after a rejection")
    parser.add_argument("--numerics", default="auto", help="auto (the exact route measured fastest here) or a route: "
                        "'fp32 exact-wm/4', 'bf16 exact-linear/16', 'fp32 linear' (not exact), ...; on llama.cpp exact or repack")
    parser.add_argument("--max-new-tokens", type=int, default=GenerationConfig.max_new_tokens)
    add_sampling_args(parser)
    parser.add_argument("--seed", type=int, default=GenerationConfig.seed)
    parser.add_argument("--json", action="store_true", help="end stdout with one JSON object")
    add_adapt_args(parser)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="draftlab", description="Lossless speculative decoding and its evidence.")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an unexpected error")
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
    bench.add_argument("--skip", type=int, default=0, help="prompts passed over first (e.g. a draft's training set)")
    bench.add_argument("--warmup", type=int, default=1)
    bench.add_argument("--servers", nargs="+", metavar="TYPE[/DRAFT][:K,...[:P,...]]",
                       help="with --backend llamacpp: llama-server's plain decoding and these speculative types of its "
                            "own in the same loop (ngram-mod, ngram-simple:16, draft-simple/DRAFT:4)")
    bench.add_argument("--no-host-baselines", action="store_true",
                       help="skip timing plain decoding in the host's other dtypes and routes")
    add_preflight_arg(bench)
    bench.set_defaults(run=cmd_bench)
    add_study_commands(sub)
    add_tune_commands(sub)
    add_design_commands(sub)
    add_audit_command(sub)
    add_serve_commands(sub)
    add_check_commands(sub)
    return parser


def _decoder(args):
    from draftlab.api import SpeculativeDecoder
    from draftlab.drafters.kinds import is_adapting
    from draftlab.registry import adapt_spec

    if args.adapt_save and args.adapt is None and not is_adapting(args.drafter):
        raise DraftlabError("--adapt-save writes what --adapt learned: add --adapt (or an adapt/... drafter)")
    args.drafter = adapt_spec(args.drafter, args.adapt)  # what the tables and JSON name
    return SpeculativeDecoder.from_names(
        args.target, drafter=args.drafter, k=args.k, dynamic_k=args.dynamic_k, device=args.device, dtype=args.dtype,
        backend=args.backend, numerics=args.numerics,
    )


def cmd_generate(args) -> None:
    """Stream the generated text, then the statistics."""
    prompt = _stdin_text() if args.prompt == "-" else args.prompt
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
    _save_adapted(decoder, args)
    stats = result.stats.to_dict()
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "target": args.target,
                          "drafter": args.drafter, "k": args.k, "numerics": decoder.target_backend.numerics,
                          **stats}))
        return
    print(
        f"-- {stats['new_tokens']} tokens in {stats['steps']} steps | {stats['tokens_per_step']:.2f} tokens/step | "
        f"acceptance {stats['acceptance_rate']:.1%} | {stats['tokens_per_s']:.1f} tokens/s | "
        f"draft {stats['draft_s']:.2f}s target {stats['target_s'] + stats['prefill_s']:.2f}s "
        f"overhead {stats['overhead_s']:.2f}s wall {stats['wall_s']:.2f}s | stop: {stats['stop_reason']}\n"
        f"-- numerics: {decoder.target_backend.numerics}",
        file=sys.stderr if args.json else sys.stdout,
    )


def cmd_bench(args) -> None:
    """Baseline vs speculative on a prompt set; a table, and JSON with --json."""
    from draftlab.bench import BenchSettings, run_bench
    from draftlab.files.datasets import load_prompts
    from draftlab.backends import LLAMA_SERVER
    from draftlab.contenders.preflight import engine_checks, require

    prompts = load_prompts(args.dataset or args.prompts, args.limit, args.skip)
    left_out = require(engine_checks(args.target, args.backend, args.device, args.dtype, bool(args.servers)),
                       args.preflight_timeout, "bench")
    servers = [] if LLAMA_SERVER.name in left_out else args.servers or []
    decoder = _decoder(args)
    settings = BenchSettings(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, args.warmup,
                             not args.no_host_baselines)
    if args.servers and not decoder.target.engine.runs_gguf:
        raise DraftlabError("--servers runs llama-server on the target's GGUF: add --backend llamacpp")
    summary = {**run_bench(decoder, prompts, settings, servers=servers).summary(),
               "numerics": decoder.target_backend.numerics}
    _save_adapted(decoder, args)
    print(format_bench_table(summary, args))
    for key, row in summary.get("llama_server", {}).items():
        print(f"{key}: {row['tokens_per_s']:.1f} tok/s, {row['speedup']:.2f}x llama-server's plain decoding "
              f"({summary['host_plain_tokens_per_s']['llama-server plain']:.1f} tok/s), decode only "
              f"{row['decode_speedup']:.2f}x; {row['identical']}/{summary['prompts']} outputs identical to it "
              "(lossless only up to rounding)")
    if args.json:
        print(json.dumps({"target": args.target, "drafter": args.drafter, "k": args.k,
                          "dtype": str(decoder.target.dtype).removeprefix("torch."), **summary}))


def _save_adapted(decoder, args) -> None:
    """Write the adapted draft where --adapt-save says (and say so)."""
    if args.adapt_save:
        path = decoder.save_draft(args.adapt_save)
        print(f"adapted draft saved to {path} (load it with --drafter model:{path})", file=sys.stderr)


def format_bench_table(summary: dict, args) -> str:
    """A table per category and overall, for people."""
    header = f"{'category':<16}{'prompts':>8}{'AR tok/s':>10}{'SpS tok/s':>11}{'speedup':>9}{'(min-max)':>14}{'TAR':>6}{'accept':>8}{'identical':>11}"
    lines = [f"target={args.target} drafter={args.drafter} k={args.k} temperature={args.temperature} "
             f"numerics={summary.get('numerics', '?')}", header]
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
    if "adapt" in summary:
        adapt = summary["adapt"]
        lines.append(f"online adaptation: {adapt['steps']} optimizer steps over {adapt['requests']} requests, "
                     f"{adapt['train_s']:.1f}s ({adapt['train_ms_per_token']:.1f} ms per new token, in the draft "
                     "time); "
                     f"acceptance first {adapt['window_requests']} requests {adapt['acceptance_first']:.1%}, last "
                     f"{adapt['acceptance_last']:.1%}")
    if "cache_held" in summary:
        held = summary["cache_held"]
        lines.append(f"cross-request cache: held {held['first_prompt']} earlier responses at the first prompt, "
                     f"{held['last_prompt']} at the last")
    plain = ", ".join(f"{label} {speed:.1f}" for label, speed in summary["host_plain_tokens_per_s"].items())
    lines.append(f"speedup over the baseline: {summary['speedup']:.2f}x end to end, {summary['decode_speedup']:.2f}x "
                 "decode only")
    lines.append(f"plain decoding on this host (tok/s): {plain}; speedup over the fastest "
                 f"({summary['fastest_plain']}): {summary['speedup_vs_fastest_plain']:.2f}x end to end, "
                 f"{summary['decode_speedup_vs_fastest_plain']:.2f}x decode only")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars would bury our own output
    hf_logging.set_verbosity_error()
    try:
        check_args(args)
        if getattr(args, "threads", None):
            import torch

            torch.set_num_threads(args.threads)
        args.run(args)
    except DraftlabError as exc:
        print(f"draftlab: error: {_one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("draftlab: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # anything not foreseen: one line, the traceback on request
        if args.debug:
            raise
        print(f"draftlab: error: {type(exc).__name__}: {_one_line(str(exc))}\n"
              "draftlab: this is unexpected; rerun with --debug (draftlab --debug COMMAND ...) for the traceback",
              file=sys.stderr)
        return 1
    return 0


def _stdin_text() -> str:
    """The prompt from standard input, which must be UTF-8 text."""
    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DraftlabError(f"the prompt on standard input is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _one_line(text: str) -> str:
    """An error message as one line (the first of several, shortened)."""
    first = text.strip().splitlines()[0] if text.strip() else "(no message)"
    return first if len(first) <= 400 else first[:397] + "..."


if __name__ == "__main__":
    sys.exit(main())

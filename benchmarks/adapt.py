"""Online adaptation: a static draft and adapting ones on the same stream of prompts, window by window.

Every prompt of the stream (a prompt set taken in order, after `--skip` prompts: by default the 60 HumanEval
prompts that follow the designed draft's training prompts) runs back to back through plain decoding, the static
draft and each adapting variant (`--adapt`, one spec option string each; they learn from the stream in order), so
machine drift hits all alike. Per window of `--window` prompts it prints acceptance, tokens per step and tok/s of
each, the adaptation's own cost (optimizer time per new token, inside every adapting tok/s) and equality with plain
decoding. Plain decoding also runs in the host's other modes (other dtypes, llama.cpp's default kernels), so every
speed is stated against the fastest plain decoding measured too. With `--save DIR` the first adapting draft is
saved at the end and reloaded with `model:DIR` as a static draft: over the last window it must accept what the
adapted draft frozen as it ended accepts, and on `--fresh` prompts after the stream it is compared with the static
draft.
The last line of stdout is one JSON document.

    python benchmarks/adapt.py --dataset humaneval --skip 60 --limit 60 --k 3
    python benchmarks/adapt.py --dataset mt-bench --limit 40 --adapt "" "lr=1e-4" --save runs/adapted
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import defaultdict

from draftlab.api import SpeculativeDecoder, build_drafter, prompt_ids
from draftlab.backends.routes import cpu_flags, cpu_model
from draftlab.files.datasets import load_prompts
from draftlab.contenders.plain import host_plain
from draftlab.models import load_model
from draftlab.decoding.policy import FixedK


def decoders(args, plain: SpeculativeDecoder) -> dict[str, SpeculativeDecoder]:
    """Name -> decoder: plain decoding (own route and the host's other modes), the static draft, the adapting ones."""
    out = {"plain": plain}
    if not args.no_host_plain:
        out.update({f"plain ({label})": decoder for label, decoder in host_plain(plain).items()})
    out["static"] = speculative(plain, args.drafter, args.k)
    for options in args.adapt:
        out[f"adapt {options or '(defaults)'}"] = speculative(plain, f"adapt{':' + options if options else ''}/"
                                                                     f"{args.drafter}", args.k)
    return out


def speculative(plain: SpeculativeDecoder, spec: str, k: int) -> SpeculativeDecoder:
    return plain.with_drafter(build_drafter(spec, plain.target, plain.backend).drafter).with_policy(FixedK(k))


def run_stream(args, runs: dict[str, SpeculativeDecoder], streams: list[list[int]]) -> dict[str, list[dict]]:
    """Every decoder on every prompt, in order; per decoder one row per prompt."""
    for decoder in runs.values():  # warm-up: first calls pay one-off costs; the adapting drafts learn nothing
        decoder.with_drafter(decoder.drafter.forgetful()).generate(streams[0], max_new_tokens=8)
    rows: dict[str, list[dict]] = defaultdict(list)
    for number, ids in enumerate(streams):
        reference = None
        for name, decoder in runs.items():
            trained_before = train_seconds(decoder)
            result = decoder.generate(ids, max_new_tokens=args.max_new_tokens)
            s = result.stats
            reference = result.token_ids if name == "plain" else reference
            rows[name].append({"tokens": s.new_tokens, "seconds": s.wall_s, "steps": s.steps, "drafted": s.drafted,
                               "accepted": s.accepted, "train_s": train_seconds(decoder) - trained_before,
                               "identical": result.token_ids == reference})
        print(f"prompt {number + 1}/{len(streams)} done", file=sys.stderr)
    return rows


def train_seconds(decoder: SpeculativeDecoder) -> float:
    return (decoder.drafter.learned() or {}).get("train_s", 0.0)


def window_table(rows: dict[str, list[dict]], window: int) -> list[dict]:
    """Per window of prompts and decoder: acceptance, tokens per step, tok/s, training ms per token."""
    table = []
    count = len(next(iter(rows.values())))
    for start in range(0, count, window):
        for name, per_prompt in rows.items():
            part = per_prompt[start : start + window]
            tokens, seconds = sum(r["tokens"] for r in part), sum(r["seconds"] for r in part)
            drafted, steps = sum(r["drafted"] for r in part), sum(r["steps"] for r in part)
            table.append({"window": f"{start + 1}-{start + len(part)}", "method": name,
                          "acceptance": sum(r["accepted"] for r in part) / drafted if drafted else None,
                          "tokens_per_step": tokens / steps if steps else None, "tokens_per_s": tokens / seconds,
                          "train_ms_per_token": 1000 * sum(r["train_s"] for r in part) / tokens,
                          "identical": sum(r["identical"] for r in part), "prompts": len(part)})
    return table


def print_table(table: list[dict]) -> None:
    print(f"{'prompts':<9}{'method':<34}{'accept':>8}{'tok/step':>10}{'tok/s':>8}{'train ms/tok':>14}{'identical':>11}")
    for row in table:
        accept = f"{row['acceptance']:.1%}" if row["acceptance"] is not None else "-"
        per_step = f"{row['tokens_per_step']:.2f}" if row["acceptance"] is not None else "-"
        print(f"{row['window']:<9}{row['method']:<34}{accept:>8}{per_step:>10}{row['tokens_per_s']:>8.1f}"
              f"{row['train_ms_per_token']:>14.1f}{row['identical']:>8}/{row['prompts']}")


def totals(rows: dict[str, list[dict]], last: int) -> dict[str, dict]:
    """Whole-stream and last-window figures per decoder."""
    out = {}
    for name, per_prompt in rows.items():
        tail = per_prompt[-last:]
        drafted, tail_drafted = sum(r["drafted"] for r in per_prompt), sum(r["drafted"] for r in tail)
        out[name] = {"tokens_per_s": sum(r["tokens"] for r in per_prompt) / sum(r["seconds"] for r in per_prompt),
                     "tokens_per_s_last": sum(r["tokens"] for r in tail) / sum(r["seconds"] for r in tail),
                     "acceptance": sum(r["accepted"] for r in per_prompt) / drafted if drafted else None,
                     "acceptance_last": sum(r["accepted"] for r in tail) / tail_drafted if tail_drafted else None,
                     "identical": sum(r["identical"] for r in per_prompt)}
    return out


def print_summary(summary: dict[str, dict], last: int) -> None:
    plain = {n: s["tokens_per_s"] for n, s in summary.items() if n.startswith("plain")}
    fastest = max(plain, key=plain.get)
    static = summary["static"]
    print(f"\nfastest plain decoding: {fastest} {plain[fastest]:.1f} tok/s")
    for name, s in summary.items():
        if not name.startswith("adapt"):
            continue
        print(f"{name}: acceptance over the last {last} prompts {s['acceptance_last']:.1%} vs static "
              f"{static['acceptance_last']:.1%} = {s['acceptance_last'] / static['acceptance_last']:.2f}x; tok/s last "
              f"{last} {s['tokens_per_s_last']:.1f} vs static {static['tokens_per_s_last']:.1f} = "
              f"{s['tokens_per_s_last'] / static['tokens_per_s_last']:.2f}x; whole stream {s['tokens_per_s']:.1f} vs "
              f"{static['tokens_per_s']:.1f} ({s['tokens_per_s'] / plain[fastest]:.2f}x the fastest plain)")


def reload_check(args, plain: SpeculativeDecoder, adapting: SpeculativeDecoder, streams: list[list[int]],
                 rows: list[dict], fresh: list[list[int]]) -> dict:
    """Save the adapting draft and reload it as a static draft: over the last window it must draft what the adapted
    draft, frozen as it ended, drafts (the same weights); on `fresh` prompts after the stream it is compared with the
    static draft (what was learned, on prompts neither saw)."""
    path = adapting.save_draft(args.save)
    reloaded = speculative(plain, f"model:{path}", args.k)
    frozen = adapting.with_drafter(adapting.drafter.forgetful())
    static = speculative(plain, args.drafter, args.k)
    tail = streams[-args.window :]
    out = {"path": path,
           "reloaded_last": acceptance(reloaded, tail, args), "frozen_last": acceptance(frozen, tail, args),
           "adapting_last": sum(r["accepted"] for r in rows[-args.window :])
           / sum(r["drafted"] for r in rows[-args.window :])}
    if fresh:
        out.update(reloaded_fresh=acceptance(reloaded, fresh, args), static_fresh=acceptance(static, fresh, args))
    print(f"\nsaved to {path}; over the last {len(tail)} prompts the reloaded draft accepts "
          f"{out['reloaded_last']:.1%}, "
          f"the adapted draft frozen as it ended {out['frozen_last']:.1%} (while it was still adapting over them: "
          f"{out['adapting_last']:.1%})")
    if fresh:
        print(f"on the {len(fresh)} prompts after the stream: reloaded {out['reloaded_fresh']:.1%}, static "
              f"{out['static_fresh']:.1%} = {out['reloaded_fresh'] / out['static_fresh']:.2f}x")
    return out


def acceptance(decoder: SpeculativeDecoder, streams: list[list[int]], args) -> float:
    runs = [decoder.generate(ids, max_new_tokens=args.max_new_tokens).stats for ids in streams]
    return sum(s.accepted for s in runs) / sum(s.drafted for s in runs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--drafter", default="designed", help="the static draft; adapting variants wrap it")
    parser.add_argument("--adapt", nargs="+", default=[""], help="adapt option strings ('' for the defaults)")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--skip", type=int, default=60, help="prompts passed over first (the draft's training set)")
    parser.add_argument("--limit", type=int, default=60)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--save", default=None, help="save the first adapting draft here, reload it, rerun the "
                                                     "last window and --fresh prompts")
    parser.add_argument("--fresh", type=int, default=10, help="with --save: prompts after the stream on which the "
                                                              "reloaded draft and the static one are compared")
    parser.add_argument("--no-host-plain", action="store_true", help="skip plain decoding in the host's other modes")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    target = load_model(args.target, dtype=args.dtype)
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1)
    runs = decoders(args, plain)
    streams = [prompt_ids(target.tokenizer, p) for p in load_prompts(args.dataset, args.limit, args.skip)]
    rows = run_stream(args, runs, streams)
    table = window_table(rows, args.window)
    print(f"target {args.target} ({plain.target_backend.numerics}), draft {args.drafter}, K={args.k}, "
          f"{args.dataset} prompts {args.skip + 1}-{args.skip + len(streams)}, {args.max_new_tokens} new tokens")
    print_table(table)
    summary = totals(rows, args.window)
    print_summary(summary, args.window)
    saved = None
    if args.save:
        first = next(name for name in runs if name.startswith("adapt"))
        fresh = [prompt_ids(target.tokenizer, p)
                 for p in load_prompts(args.dataset, args.fresh, args.skip + len(streams))] if args.fresh else []
        saved = reload_check(args, plain, runs[first], streams, rows[first], fresh)
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16"})
    print(f"\nhost: {cpu_model()} ({' '.join(flags)}), Python {platform.python_version()}; "
          f"{time.perf_counter() - started:.0f} s")
    print("command: python benchmarks/adapt.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(json.dumps({"target": args.target, "drafter": args.drafter, "k": args.k, "dataset": args.dataset,
                      "skip": args.skip, "windows": table, "summary": summary, "saved": saved}))


if __name__ == "__main__":
    main()

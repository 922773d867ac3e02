"""`draftlab serve`: the answer as an OpenAI-compatible server on draftlab's exact engine; `draftlab serve-check`: a
llama-server command re-measured on the user's prompts against its plain decoding."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from draftlab.engine import GenerationConfig


SERVE_TARGET = "smollm2-135m@Q4_0_PURE"  # the embedded target in the type the exact kernels run fastest
TORCH_TARGET = "smollm2-135m"  # the embedded target on the torch backends
GRACE_S = 120  # after SIGTERM, how long requests in flight may take to finish


def add_serve_commands(sub) -> None:
    """The serve and serve-check subcommands."""
    serve = sub.add_parser("serve", help="serve a target over the OpenAI API on draftlab's exact speculative engine")
    serve.add_argument("--from", dest="from_study", default=None, metavar="DIR",
                       help="serve a study's answer (its directory): target, drafter and K per load as it measured")
    serve.add_argument("--target", default=None,
                       help=f"short name (NAME@TYPE for a derived GGUF), .gguf file or, on a torch backend, an HF "
                            f"directory (default {SERVE_TARGET}; on torch {TORCH_TARGET})")
    serve.add_argument("--drafter", default=None, help="none (plain decoding; the default), ngram, ngram:MIN-MAX, "
                                                      "suffix[:OPTIONS], or a draft model: model:NAME_OR_GGUF, "
                                                      "layers:LIST (each request's draft in a stream of its own)")
    serve.add_argument("--k", default=None, help="draft tokens per step, or auto (the default with a drafter): each "
                                                 "request's K chosen at every step by expected tokens per second, "
                                                 "from its acceptance so far and this host's cost of a step's rows")
    serve.add_argument("--k-max", type=int, default=8, help="--k auto's deepest draft (default 8)")
    serve.add_argument("--cost-profile", default="", metavar="FILE",
                       help="--k auto's cost of a step's rows from a profile timed here on the same numerics "
                            "(`draftlab calibrate --backend llamacpp`, a study's profile.json; default: timed at start)")
    serve.add_argument("--k-per-load", default=None, metavar="ROWS",
                       help="K by requests in flight, rows LO-HI:K from 1 on, e.g. 1-2:6,3-4:3,5-8:0 (0: plain "
                            "decoding; auto: K chosen each step at those loads, e.g. 1:3,2-64:auto)")
    serve.add_argument("--backend", default="llamacpp",
                       help="llamacpp (the GGUF's own types; the default) or a torch backend: auto, fast, hf")
    serve.add_argument("--device", default="cpu", help="torch backends: cpu or cuda")
    serve.add_argument("--dtype", default="auto", help="torch backends: the weights' dtype (auto: the exact route "
                                                      "measured fastest here)")
    serve.add_argument("--numerics", default="exact", help="exact (every output as the request alone), llama.cpp's "
                                                          "repack, or a torch route label ('fp32 exact-linear/16')")
    serve.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: the cores here)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1 only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default="", help="require Authorization: Bearer KEY on /v1 routes")
    serve.add_argument("--max-in-flight", type=int, default=4, help="requests decoded at once (slots)")
    serve.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond those; more get a 429")
    serve.add_argument("--context", type=int, default=None, help="KV cells per slot (default: the model's, <= 8192)")
    serve.add_argument("--served-model-name", default="", help="the model's name in the API (default: --target)")
    serve.add_argument("--suffix-cache", default="", metavar="DIR",
                       help="keep suffix decoding's cache of answers in DIR across restarts")
    serve.add_argument("--no-prompt-cache", dest="prompt_cache", action="store_false",
                       help="prefill every prompt whole (default: a prompt that starts with an earlier request's "
                            "tokens, a chat's next turn, reuses its slot's cells)")
    serve.set_defaults(run=cmd_serve)
    check = sub.add_parser("serve-check", help="re-measure a llama-server command against its own plain decoding")
    check.add_argument("server_command", metavar="COMMAND",
                       help="the llama-server command line, quoted: 'llama-server -m MODEL.gguf --spec-type ngram-mod' "
                            "(-m takes a path or a draftlab short name; --host and --port are dropped: it runs on "
                            "127.0.0.1)")
    source = check.add_mutually_exclusive_group()
    source.add_argument("--dataset", default="code-edit", help="a prompt set (code-edit, humaneval, mixed, ...)")
    source.add_argument("--prompts", help="JSONL file with a 'prompt' per line")
    check.add_argument("--limit", type=int, default=6)
    check.add_argument("--skip", type=int, default=0)
    check.add_argument("--max-new-tokens", type=int, default=GenerationConfig.max_new_tokens)
    check.add_argument("--concurrency", default=None, metavar="N,N,...",
                       help="also measure under load: that many slots and requests in flight, e.g. 1,2,4")
    check.add_argument("--log-dir", default=None, help="where the servers' logs go (default: a temporary directory)")
    check.add_argument("--json", action="store_true", help="end stdout with one JSON object")
    check.set_defaults(run=cmd_serve_check)


def cmd_serve(args: argparse.Namespace) -> None:
    """Load, then serve until SIGINT/SIGTERM (uvicorn drains what is in flight first)."""
    import uvicorn

    from draftlab.decoding.kchoice import LoadK
    from draftlab.serving.app import create_app
    from draftlab.serving.build import ServeSettings, build_served

    target, drafter, ks = _what_to_serve(args)
    settings = ServeSettings(target, drafter, ks, args.k_max, args.max_in_flight, args.max_queue, args.context,
                             args.numerics, args.served_model_name, args.api_key, args.suffix_cache, args.threads,
                             args.backend, args.device, args.dtype, args.prompt_cache, args.cost_profile)
    served = build_served(settings)
    k = ("K chosen each step (auto)" if settings.ks is None else "plain decoding" if settings.ks == LoadK.fixed(0)
         else f"K per requests in flight {settings.ks.text()}")
    print(f"draftlab serve: {settings.target} on {served.numerics} with {settings.drafter}, {k}, {settings.slots} "
          f"slots{'' if served.scheduler.prefixes else ', no prompt cache'}, on http://{args.host}:{args.port}/v1",
          flush=True)
    uvicorn.run(create_app(served), host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=GRACE_S)


def _what_to_serve(args: argparse.Namespace):
    """(target, drafter, K per load): a study's answer with --from, else the flags."""
    from draftlab.backends import engine_of_backend
    from draftlab.errors import DraftlabError
    from draftlab.decoding.kchoice import LoadK

    if args.from_study is None:
        drafter = args.drafter or "none"
        default = SERVE_TARGET if engine_of_backend(args.backend).runs_gguf else TORCH_TARGET
        return args.target or default, drafter, _serve_ks(args, drafter)
    if args.drafter is not None or args.k is not None or args.k_per_load is not None:
        raise DraftlabError("--from serves the study's drafter and K; leave --drafter, --k and --k-per-load out")
    from draftlab.study.answer.serve_deploy import serve_from_study

    config = serve_from_study(args.from_study, args.target)
    print(f"draftlab serve: the answer of {args.from_study}: {config.target} with {config.drafter}, K per requests in "
          f"flight {config.k_per_load}", flush=True)
    return config.target, config.drafter, None if config.k_per_load == "auto" else LoadK.parse(config.k_per_load)


def _serve_ks(args: argparse.Namespace, drafter: str):
    """--k-per-load, else --k for every load (plain decoding without a drafter; None: auto, the default with one)."""
    from draftlab.drafters.kinds import is_plain_drafter
    from draftlab.errors import DraftlabError
    from draftlab.decoding.kchoice import LoadK

    if args.k_per_load:
        if args.k is not None:
            raise DraftlabError("give --k or --k-per-load, not both")
        return LoadK.parse(args.k_per_load)
    if is_plain_drafter(drafter):
        return LoadK.fixed(0)
    if args.k is None or args.k == "auto":
        if args.k_max < 1:
            raise DraftlabError(f"--k-max must be >= 1, got {args.k_max}")
        return None
    if not args.k.isdigit():
        raise DraftlabError(f"--k takes a number >= 0 or auto, not {args.k!r}")
    return LoadK.fixed(int(args.k))


def cmd_serve_check(args: argparse.Namespace) -> None:
    """Both servers on every prompt; a verdict, and JSON with --json."""
    from draftlab.api import prompt_ids
    from draftlab.files.datasets import load_prompts
    from draftlab.measure import EncodedPrompt, RunSettings
    from draftlab.models import gguf_tokenizer
    from draftlab.contenders.serve_check import as_dict, parse_command, serve_check, serve_check_load

    config = parse_command(args.server_command)
    levels = _levels(args.concurrency)
    prompts = load_prompts(args.prompts or args.dataset, args.limit, args.skip)
    tokenizer = gguf_tokenizer(str(config.model))
    encoded = [EncodedPrompt(p.id, p.category, prompt_ids(tokenizer, p)) for p in prompts]
    with tempfile.TemporaryDirectory() as scratch:
        log_dir = Path(args.log_dir) if args.log_dir else Path(scratch)
        check = serve_check(config, encoded, RunSettings(args.max_new_tokens), log_dir)
        load = serve_check_load(config, encoded, RunSettings(args.max_new_tokens), levels, log_dir) if levels else []
    print(f"command:        {check.command}\nplain decoding: {check.plain_command}")
    print(f"tokens/s end to end: plain {check.tokens_per_s['plain']:.1f}, command {check.tokens_per_s['command']:.1f}"
          f"; drafted {check.drafted}, accepted {check.accepted}")
    if load:
        print(_load_table(load, config.draft_n_max))
    print(f"serve-check: {check.verdict()}")
    if args.json:
        print(json.dumps(as_dict(check, load)))


def _levels(text: str | None) -> list[int]:
    """--concurrency 1,2,4 -> [1, 2, 4] (a one-line error for anything else)."""
    from draftlab.errors import DraftlabError

    if text is None:
        return []
    try:
        levels = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise DraftlabError(f"--concurrency takes counts like 1,2,4, not {text!r}") from None
    if not levels or levels[0] < 1 or levels[-1] > 64:
        raise DraftlabError(f"--concurrency levels must be 1..64, got {text!r}")
    return levels


def _load_table(load, k: int | None) -> str:
    """Per concurrency, both servers' aggregate tokens/s and latency, and where speculation stops paying."""
    from draftlab.contenders.serve_check import level_pays, pays_up_to
    from draftlab.deploy import per_batch_size

    lines = [f"{'concurrency':>11}{'plain tok/s':>13}{'command tok/s':>15}{'speedup':>9}{'latency plain/command':>24}"
             f"{'identical':>11}"]
    for level in load:
        lines.append(f"{level.concurrency:>11}{level.plain_tokens_per_s:>13.1f}{level.command_tokens_per_s:>15.1f}"
                     f"{level.speedup:>8.2f}x{level.plain_latency_s:>13.2f}s /{level.command_latency_s:>6.2f}s"
                     f"{level.identical:>8}/{level.prompts}")
    pays = pays_up_to(load)
    lines.append(f"under load: the command pays up to {pays} concurrent request(s)" if pays else
                 "under load: the command does not pay at any concurrency measured")
    if k is not None:
        lines.append(f"as vLLM's num_speculative_tokens_per_batch_size: {per_batch_size(level_pays(load), k)}")
    return "\n".join(lines)

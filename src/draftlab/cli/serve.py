"""`draftlab serve-check`: a llama-server command re-measured on the user's prompts against its plain decoding."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from draftlab.engine import GenerationConfig


def add_serve_commands(sub) -> None:
    """The serve-check subcommand."""
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
    check.add_argument("--log-dir", default=None, help="where the servers' logs go (default: a temporary directory)")
    check.add_argument("--json", action="store_true", help="end stdout with one JSON object")
    check.set_defaults(run=cmd_serve_check)


def cmd_serve_check(args: argparse.Namespace) -> None:
    """Both servers on every prompt; a verdict, and JSON with --json."""
    from draftlab.api import prompt_ids
    from draftlab.datasets import load_prompts
    from draftlab.measure import EncodedPrompt, RunSettings
    from draftlab.models import gguf_tokenizer
    from draftlab.serve_check import as_dict, parse_command, serve_check

    config = parse_command(args.server_command)
    prompts = load_prompts(args.prompts or args.dataset, args.limit, args.skip)
    tokenizer = gguf_tokenizer(str(config.model))
    encoded = [EncodedPrompt(p.id, p.category, prompt_ids(tokenizer, p)) for p in prompts]
    with tempfile.TemporaryDirectory() as scratch:
        log_dir = Path(args.log_dir) if args.log_dir else Path(scratch)
        check = serve_check(config, encoded, RunSettings(args.max_new_tokens), log_dir)
    print(f"command:        {check.command}\nplain decoding: {check.plain_command}")
    print(f"tokens/s end to end: plain {check.tokens_per_s['plain']:.1f}, command {check.tokens_per_s['command']:.1f}"
          f"; drafted {check.drafted}, accepted {check.accepted}")
    print(f"serve-check: {check.verdict()}")
    if args.json:
        print(json.dumps(as_dict(check)))

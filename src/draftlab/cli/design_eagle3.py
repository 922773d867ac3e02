"""`draftlab design eagle3`: train an EAGLE-3 draft, write the engines' checkpoint and llama.cpp's GGUF of it."""

from __future__ import annotations

from pathlib import Path

from draftlab.cli.design_text import add_text_args, frequent_greedy_tokens, text_record
from draftlab.errors import DraftlabError

TARGET_DIR = "target-hf"  # inside --out: the target's config and tokenizer, for llama.cpp's converter


def add_eagle3_command(commands) -> None:
    """Register `design eagle3` on the design subparsers."""
    eagle3 = commands.add_parser("eagle3", help="train an EAGLE-3 draft (three fused target layers, training-time "
                                                "test); write it for vLLM, SGLang and llama.cpp")
    add_text_args(eagle3)
    eagle3.add_argument("--vocab", type=int, default=8192, help="draft output rows: the target's most frequent tokens")
    eagle3.add_argument("--intermediate-size", type=int, default=None,
                        help="the draft layer's MLP width (default: the target's; its strongest channels are kept)")
    eagle3.add_argument("--aux-layers", type=int, nargs=3, default=None,
                        help="the three target layers read (default: 2, L/2, L-3, as vLLM and llama.cpp)")
    eagle3.add_argument("--out", required=True, help="draft directory; holds text, features, checkpoints; resumes")
    eagle3.add_argument("--budget", type=float, default=900.0, help="training seconds (excluding the target pass)")
    eagle3.add_argument("--steps", type=int, default=None,
                        help="train this many steps instead of --budget seconds (the same draft from the same seed)")
    eagle3.add_argument("--checkpoint-every", type=float, default=120.0, help="seconds between checkpoints")
    eagle3.add_argument("--seq-len", type=int, default=256)
    eagle3.add_argument("--batch-size", type=int, default=8)
    eagle3.add_argument("--lr", type=float, default=1e-3)
    eagle3.add_argument("--ttt-steps", type=int, default=3, help="drafted positions training unrolls")
    eagle3.add_argument("--seed", type=int, default=0)
    eagle3.add_argument("--reuse-text", nargs="*", default=[],
                        help="earlier draft directories (or text.pt files) whose training text is added")
    eagle3.add_argument("--from", dest="source", default=None,
                        help="write the engines' files (checkpoint, --gguf) of this EAGLE-3 draft instead of training: "
                             "'eagle3' (the one shipped for --target) or a draft directory")
    eagle3.add_argument("--gguf", action="store_true",
                        help="also write eagle3-draft.gguf with llama.cpp's converter (needs "
                             "scripts/build-llama-cpp.sh)")
    eagle3.set_defaults(run=cmd_eagle3)
    return eagle3


def cmd_eagle3(args) -> None:
    """Train an EAGLE-3 draft within the budget (resuming from --out); write its checkpoint (and GGUF)."""
    from draftlab.design.corpus import cached_text
    from draftlab.design.eagle3 import Eagle3Settings, load_or_make_taps, train_eagle3_draft
    from draftlab.design.training import CHECKPOINT
    from draftlab.drafters.eagle3 import Eagle3Shape, is_eagle3_draft, load_eagle3_draft, new_eagle3_draft
    from draftlab.models import load_model

    if args.source:
        return export_existing(args)
    settings = Eagle3Settings(budget_s=args.budget, max_steps=args.steps, seq_len=args.seq_len,
                              batch_size=args.batch_size, lr=args.lr, checkpoint_every_s=args.checkpoint_every,
                              seed=args.seed, ttt_steps=args.ttt_steps)
    out = Path(args.out)
    target = load_model(args.target)
    taps = Eagle3Shape.of(target.model.config, args.intermediate_size, args.aux_layers).aux_layers
    sequences = cached_text(out, target, args.datasets, args.limit, args.generate, args.max_new_tokens, args.corpus,
                            args.reuse_text, progress=not args.no_progress)
    data = load_or_make_taps(out, target, sequences, taps, settings, progress=not args.no_progress)
    if (out / CHECKPOINT).exists() and is_eagle3_draft(out):
        draft = load_eagle3_draft(out, target)
    else:
        import torch

        torch.manual_seed(args.seed)
        vocab_map = frequent_greedy_tokens(target, data, args.vocab)
        draft = new_eagle3_draft(target, vocab_map, args.intermediate_size, taps)
        draft.made = {"method": "EAGLE-3 (three fused target layers, training-time test)",
                      "init": "last target layer, fc on the highest tap", "text": text_record(args, data)}
    history = train_eagle3_draft(target, draft, sequences, out, settings, args.target, progress=not args.no_progress)
    if history:
        last = history[-1]
        depth = ", ".join(f"{a:.1%}" for a in last.get("held_out_agreement_by_depth", []))
        print(f"eagle3: {last['tokens']} tokens in {last['elapsed_s']:.0f}s ({last['step']} steps), held-out "
              f"agreement {history[0]['held_out_agreement']:.1%} -> {last['held_out_agreement']:.1%} "
              f"(by drafted position: {depth}) -> {out}")
    write_for_engines(draft, target, out, args.gguf)


def export_existing(args) -> None:
    """The engines' files of an EAGLE-3 draft that exists: the shipped one (`--from eagle3`) or a directory."""
    from draftlab.drafters.eagle3 import is_eagle3_draft, load_eagle3_draft
    from draftlab.drafters.shipped import shipped_draft
    from draftlab.models import load_model

    target = load_model(args.target)
    source = shipped_draft(target.name, "eagle3") if args.source == "eagle3" else Path(args.source)
    if not is_eagle3_draft(source):
        raise DraftlabError(f"--from {args.source}: not an EAGLE-3 draft directory (or 'eagle3', the shipped one)")
    write_for_engines(load_eagle3_draft(source, target), target, Path(args.out), args.gguf)


def write_for_engines(draft, target, out: Path, gguf: bool) -> None:
    """The engines' checkpoint of the draft in `out`, and with `gguf` llama.cpp's GGUF; print where."""
    from draftlab.design import eagle3_gguf
    from draftlab.drafters.eagle3_checkpoint import engine_files, write_checkpoint

    checkpoint_dir, gguf_file = engine_files(out)
    checkpoint = write_checkpoint(draft, target, checkpoint_dir)
    print(f"eagle3: checkpoint for vLLM and SGLang (method eagle3 / EAGLE3): {checkpoint}")
    if not gguf:
        return
    target_dir = eagle3_gguf.write_target_dir(target, out / TARGET_DIR)
    path = eagle3_gguf.to_gguf(checkpoint, target_dir, gguf_file)
    print(f"eagle3: GGUF for llama-server (-md {path} --spec-type draft-eagle3): {path}")
    if not path.stat().st_size:
        raise DraftlabError(f"llama.cpp's converter wrote an empty {path}")

"""`draftlab design ...`: microbench, prune, cut, distill, feature, eagle3 (`design_eagle3.py`), heads, correlate."""

from __future__ import annotations

from pathlib import Path

from draftlab.errors import DraftlabError
from draftlab.defaults import DraftSettings
from draftlab.models import DEFAULT_TARGET
from draftlab.cli.design_eagle3 import add_eagle3_command
from draftlab.cli.design_text import add_text_args, check_vocab_size, frequent_greedy_tokens, text_record


def add_design_commands(sub) -> None:
    """Register the design subcommands on the top-level subparsers."""
    design = sub.add_parser("design", help="draft design: microbench, prune, cut, distill, feature, eagle3, heads, correlate")
    commands = design.add_subparsers(dest="design", required=True)

    micro = commands.add_parser("microbench", help="decode latency vs depth and width in the target's family")
    micro.add_argument("--target", default=DEFAULT_TARGET)
    micro.add_argument("--out", required=True, help="folder for the table (JSON) and plots")
    micro.add_argument("--context", type=int, default=128)
    micro.add_argument("--steps", type=int, default=20)
    micro.set_defaults(run=cmd_microbench)

    prune = commands.add_parser("prune", help="cut a draft from the target: layers (chosen or searched), vocabulary")
    add_text_args(prune)
    layers = prune.add_mutually_exclusive_group(required=True)
    layers.add_argument("--layers", help="layer list, e.g. 0-3 or 0-29:10")
    layers.add_argument("--search", type=int, help="search this many layers for the best agreement with the target")
    prune.add_argument("--vocab", type=int, default=None, help="keep only this many most frequent output tokens")
    prune.add_argument("--out", required=True, help="draft directory (use it as --drafter model:DIR)")
    prune.set_defaults(run=cmd_prune)

    cut = commands.add_parser("cut", help="cut a stand-alone draft model's vocabulary to the most frequent tokens")
    add_text_args(cut)
    cut.add_argument("--draft", required=True, help="the stand-alone draft: short name, .gguf path or HF directory")
    cut.add_argument("--vocab", type=int, required=True,
                     help="keep this many output tokens: the text's most frequent, topped up with the lowest ids")
    cut.add_argument("--out", required=True, help="draft directory (use it as --drafter model:DIR)")
    cut.set_defaults(run=cmd_cut)

    distill = commands.add_parser("distill", help="train a draft on the target's distributions within a budget")
    add_text_args(distill)
    distill.add_argument("--init", help="a pruned draft directory to start from (default: --layers/--vocab)")
    distill.add_argument("--layers", default="0-3")
    distill.add_argument("--vocab", type=int, default=None)
    distill.add_argument("--out", required=True, help="draft directory; holds checkpoints, resumes if present")
    distill.add_argument("--budget", type=float, default=600.0, help="training seconds (excluding the teacher pass)")
    distill.add_argument("--checkpoint-every", type=float, default=60.0, help="seconds between checkpoints")
    distill.add_argument("--seq-len", type=int, default=128)
    distill.add_argument("--batch-size", type=int, default=8)
    distill.add_argument("--lr", type=float, default=2e-3)
    distill.add_argument("--top-k", type=int, default=32, help="teacher logits cached per position")
    distill.set_defaults(run=cmd_distill)

    feature = commands.add_parser("feature", help="train an EAGLE-style draft that reads the target's hidden states")
    add_text_args(feature)
    feature.add_argument("--vocab", type=int, default=8192, help="draft output rows: the target's most frequent tokens")
    feature.add_argument("--out", required=True, help="draft directory; holds text, features, checkpoints; resumes")
    feature.add_argument("--budget", type=float, default=1800.0, help="training seconds (excluding the target pass)")
    feature.add_argument("--checkpoint-every", type=float, default=120.0, help="seconds between checkpoints")
    feature.add_argument("--seq-len", type=int, default=256)
    feature.add_argument("--batch-size", type=int, default=8)
    feature.add_argument("--lr", type=float, default=1e-3)
    feature.add_argument("--random-init", action="store_true", help="start from random weights, not the last layer")
    feature.add_argument("--init", help="an earlier feature draft directory to start from (its weights and vocabulary)")
    feature.add_argument("--reuse-text", nargs="*", default=[],
                         help="earlier draft directories (or text.pt files) whose training text is added")
    feature.set_defaults(run=cmd_feature)

    heads = commands.add_parser("heads", help="train Medusa-style decoder heads on the target's hidden states")
    add_text_args(heads)
    heads.add_argument("--heads", type=int, default=4, help="number of heads: the deepest chain or tree they draft")
    heads.add_argument("--vocab", type=int, default=8192, help="draft output rows: the target's most frequent tokens")
    heads.add_argument("--features", help="a feature draft directory (or its features.pt) whose cached target "
                                          "features to train on, instead of running the target over new text")
    heads.add_argument("--out", required=True, help="draft directory; holds features, checkpoints; resumes")
    heads.add_argument("--budget", type=float, default=600.0, help="training seconds (excluding the target pass)")
    heads.add_argument("--checkpoint-every", type=float, default=60.0, help="seconds between checkpoints")
    heads.add_argument("--seq-len", type=int, default=256)
    heads.add_argument("--batch-size", type=int, default=8)
    heads.add_argument("--lr", type=float, default=1e-3)
    heads.set_defaults(run=cmd_heads)

    correlate = commands.add_parser("correlate", help="draft LM quality (perplexity, MMLU) against TAR")
    correlate.add_argument("--target", default=DEFAULT_TARGET)
    correlate.add_argument("--drafts", nargs="+", required=True, help="drafter specs: layers:..., model:DIR")
    correlate.add_argument("--dataset", default="mt-bench", help="prompts for TAR")
    correlate.add_argument("--limit", type=int, default=4)
    correlate.add_argument("--skip", type=int, default=0, help="pass over the first prompts (a draft's training set)")
    correlate.add_argument("--k", type=int, default=DraftSettings.k)
    correlate.add_argument("--max-new-tokens", type=int, default=64)
    correlate.add_argument("--mmlu", type=int, default=40, help="MMLU questions to score")
    correlate.add_argument("--out", required=True)
    correlate.set_defaults(run=cmd_correlate)

    eagle3 = add_eagle3_command(commands)

    for parser in (micro, prune, cut, distill, feature, eagle3, heads, correlate):
        parser.add_argument("--threads", type=int, default=None)
        parser.add_argument("--no-progress", action="store_true")


def _target_and_text(args):
    from draftlab.design.corpus import gather
    from draftlab.models import load_model

    target = load_model(args.target)
    sequences = gather(target, args.datasets, args.limit, args.generate, args.max_new_tokens, args.corpus,
                       progress=not args.no_progress)
    return target, sequences


def _vocab_map(target, sequences, size):
    from draftlab.api import eos_ids
    from draftlab.design.layer_search import frequent_tokens

    if size is None:
        return None
    check_vocab_size(target, size)
    vocab_map = frequent_tokens(sequences, size, always=eos_ids(target))
    if len(vocab_map) < size:
        print(f"note: the text holds only {len(vocab_map)} distinct tokens, so the draft's vocabulary has "
              f"{len(vocab_map)} rows, not {size}; give more text (--limit, --generate, --corpus) for a larger one")
    return vocab_map


def cmd_microbench(args) -> None:
    """Time random-weight shapes of the target's family; print, plot, save."""
    from transformers import AutoConfig

    from draftlab.design import microbench
    from draftlab.models import resolve_directory

    config = AutoConfig.from_pretrained(resolve_directory(args.target))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timings = microbench.run(config, args.context, args.steps, progress=not args.no_progress)
    print(microbench.format_table(timings))
    for path in [microbench.save(timings, out), *microbench.plot(timings, out)]:
        print(f"wrote {path}")


def cmd_prune(args) -> None:
    """Build and save a pruned draft, with its agreement on held-out calibration text."""
    import torch

    from draftlab.api import parse_layers
    from draftlab.design.layer_search import agreement, build_draft, save_draft, search_layers, target_next_tokens

    target, sequences = _target_and_text(args)
    vocab_map = _vocab_map(target, sequences, args.vocab)
    tensors = [torch.tensor(s[:256]) for s in sequences if len(s) > 1]
    calibration, held_out = tensors[: max(1, len(tensors) * 3 // 4)], tensors[max(1, len(tensors) * 3 // 4):] or tensors
    if args.search:
        layers, _ = search_layers(target, calibration, args.search, vocab_map, progress=not args.no_progress)
        how = f"greedy search for {args.search} layers on {sum(map(len, calibration))} calibration tokens"
    else:
        layers = parse_layers(args.layers, target.model.config.num_hidden_layers)
        how = f"layers {args.layers}"
    draft = build_draft(target, layers, vocab_map)
    score = agreement(target_next_tokens(target, held_out), draft, held_out)
    vocab = None if draft.vocab_map is None else len(draft.vocab_map)
    draft.made = {"method": "prune", "how": how, "layers": layers, "vocab": vocab,
                  "held_out_agreement": round(score, 4), "held_out_tokens": sum(map(len, held_out))}
    save_draft(draft, args.out, args.target)
    print(f"prune: layers {layers}, vocabulary {vocab or 'full'}, held-out agreement with the target "
          f"{score:.1%} -> {args.out} (use --drafter model:{args.out})")


def cmd_cut(args) -> None:
    """Save a cut-vocabulary version of a stand-alone draft: its most frequent tokens in the text."""
    from draftlab.api import eos_ids
    from draftlab.design.layer_search import fill_by_rank, frequent_tokens
    from draftlab.drafters.cut import CutDraft, load_cut_model, save_cut_draft
    from draftlab.drafters.standalone import check_compatible

    target, sequences = _target_and_text(args)
    check_vocab_size(target, args.vocab)
    from_text = frequent_tokens(sequences, args.vocab, always=eos_ids(target))
    vocab_map = fill_by_rank(from_text, args.vocab, target.vocab_size)
    draft = CutDraft(args.draft, vocab_map)
    check_compatible(target, load_cut_model(draft, target))
    kept = set(vocab_map.tolist())
    total = sum(map(len, sequences))
    coverage = sum(t in kept for s in sequences for t in s) / max(1, total)
    draft.made = {"method": "cut", "vocab": len(vocab_map), "from_text": len(from_text), "datasets": args.datasets,
                  "limit": args.limit, "generate": args.generate, "corpus": args.corpus, "text_tokens": total,
                  "text_coverage": round(coverage, 4)}
    save_cut_draft(draft, args.out, target)
    filled = len(vocab_map) - len(from_text)
    print(f"cut: {args.draft} keeps {len(vocab_map)} of {target.vocab_size} output tokens ({len(from_text)} most "
          f"frequent in the text" + (f", {filled} lowest-numbered others" if filled else "") + f"), covering "
          f"{coverage:.1%} of the {total} text tokens -> {args.out} (use --drafter model:{args.out})")


def cmd_distill(args) -> None:
    """Distil a draft within the budget; resumes from --out's checkpoint."""
    from draftlab.api import parse_layers
    from draftlab.design.distill import DistillSettings, distill
    from draftlab.design.training import CHECKPOINT
    from draftlab.drafters.designed import build_draft, is_draft_dir, load_draft

    settings = DistillSettings(budget_s=args.budget, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                               top_k=args.top_k, checkpoint_every_s=args.checkpoint_every)
    target, sequences = _target_and_text(args)
    out = Path(args.out)
    start = out if (out / CHECKPOINT).exists() else (Path(args.init) if args.init else None)
    if start is not None and is_draft_dir(start):
        draft = load_draft(start, target)
    else:
        draft = build_draft(target, parse_layers(args.layers, target.model.config.num_hidden_layers),
                            _vocab_map(target, sequences, args.vocab))
    draft.made = {**draft.made, "method": "prune+distill"}
    distill(target, draft, sequences, out, settings, args.target, progress=not args.no_progress)
    history = draft.made.get("distill", {}).get("history", [])
    if history:
        last = history[-1]
        print(f"distill: {last['tokens']} tokens in {last['elapsed_s']:.0f}s, held-out agreement "
              f"{history[0]['held_out_agreement']:.1%} -> {last['held_out_agreement']:.1%} -> {out}")


def cmd_feature(args) -> None:
    """Train a feature draft within the budget; resumes from --out."""
    from draftlab.design.corpus import cached_text
    from draftlab.design.feature import FeatureSettings, load_or_make_features, train_feature_draft
    from draftlab.design.training import CHECKPOINT
    from draftlab.drafters.feature import is_feature_draft, load_feature_draft, new_feature_draft
    from draftlab.models import load_model

    settings = FeatureSettings(budget_s=args.budget, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                               checkpoint_every_s=args.checkpoint_every)
    if args.init and not is_feature_draft(args.init):
        raise DraftlabError(f"--init {args.init} is not a feature draft directory")
    out = Path(args.out)
    target = load_model(args.target)
    sequences = cached_text(out, target, args.datasets, args.limit, args.generate, args.max_new_tokens, args.corpus,
                            args.reuse_text, progress=not args.no_progress)
    data = load_or_make_features(out, target, sequences, settings, progress=not args.no_progress)
    if (out / CHECKPOINT).exists() and is_feature_draft(out):
        draft = load_feature_draft(out, target)
    elif args.init:
        draft = load_feature_draft(args.init, target)
        draft.made = {**draft.made, "init": f"feature draft {args.init}", "text": text_record(args, data)}
    else:
        vocab_map = frequent_greedy_tokens(target, data, args.vocab)  # what the draft must predict
        draft = new_feature_draft(target, vocab_map, init_layer=None if args.random_init else -1)
        draft.made = {"method": "feature (EAGLE-style)", "init": "random" if args.random_init else "last target layer",
                      "text": text_record(args, data)}
    history = train_feature_draft(target, draft, sequences, out, settings, args.target, progress=not args.no_progress)
    if history:
        print(f"feature: {history[-1]['tokens']} tokens in {history[-1]['elapsed_s']:.0f}s, held-out agreement "
              f"{history[0]['held_out_agreement']:.1%} -> {history[-1]['held_out_agreement']:.1%} -> {out}")


def cmd_heads(args) -> None:
    """Train decoder heads within the budget; resumes from --out."""
    from draftlab.design.corpus import cached_text
    from draftlab.design.feature import FEATURES, load_or_make_features
    from draftlab.design.heads import HeadsSettings, train_heads
    from draftlab.design.training import CHECKPOINT
    from draftlab.drafters.heads import is_heads_draft, load_heads_draft, new_heads_draft
    from draftlab.models import load_model

    settings = HeadsSettings(budget_s=args.budget, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                             checkpoint_every_s=args.checkpoint_every)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_model(args.target)
    if args.features:
        _link_features(Path(args.features), out / FEATURES)
        sequences: list[list[int]] = []
    else:
        sequences = cached_text(out, target, args.datasets, args.limit, args.generate, args.max_new_tokens,
                                args.corpus, [], progress=not args.no_progress)
    data = load_or_make_features(out, target, sequences, settings.features(), progress=not args.no_progress)
    if (out / CHECKPOINT).exists() and is_heads_draft(out):
        draft = load_heads_draft(out, target)
    else:
        vocab_map = frequent_greedy_tokens(target, data, args.vocab)
        draft = new_heads_draft(target, vocab_map, args.heads)
        draft.made = {"method": "decoder heads (Medusa-style)", "heads": args.heads,
                      "text": {"features": args.features, "tokens": int(data["tokens"].numel())}
                      if args.features else text_record(args, data)}
    history = train_heads(target, draft, sequences, out, settings, args.target, progress=not args.no_progress)
    if history:
        per_head = ", ".join(f"{a:.1%}" for a in draft.made.get("held_out_agreement_per_head", []))
        print(f"heads: {history[-1]['tokens']} tokens in {history[-1]['elapsed_s']:.0f}s, held-out agreement of "
              f"head 1 {history[0]['held_out_agreement']:.1%} -> {history[-1]['held_out_agreement']:.1%} "
              f"(heads 1..{draft.heads.count}: {per_head}) -> {out} (use --drafter model:{out})")


def _link_features(source: Path, destination: Path) -> None:
    """Share another draft's cached target features (a hard link where possible, else a copy)."""
    import os
    import shutil

    from draftlab.design.feature import FEATURES

    source = source / FEATURES if source.is_dir() else source
    if not source.is_file():
        raise DraftlabError(f"--features {source}: no cached target features there (a feature draft directory "
                            f"made by `draftlab design feature` holds {FEATURES})")
    if destination.exists():
        if destination.stat().st_size != source.stat().st_size:
            raise DraftlabError(f"{destination} holds other features than {source}; delete it or choose another --out")
        return
    try:
        os.link(source, destination)
    except OSError:
        shutil.copyfile(source, destination)


def cmd_correlate(args) -> None:
    """Quality vs TAR for a set of drafts."""
    import random

    from draftlab.api import prompt_ids
    from draftlab.files.datasets import load_prompts, mmlu_items
    from draftlab.design import correlate
    from draftlab.design.corpus import prompt_sequences
    from draftlab.models import load_model

    target = load_model(args.target)
    # The last xsum documents: outside what `design distill` trains on by default (the first --limit).
    held_out = [s[:256] for s in prompt_sequences(target, ["xsum"], None)[-8:]]
    items = mmlu_items()
    mmlu = random.Random(0).sample(items, min(args.mmlu, len(items)))
    prompts = [prompt_ids(target.tokenizer, p) for p in load_prompts(args.dataset, args.limit, args.skip)]
    results = correlate.measure(target, args.drafts, held_out, mmlu, prompts, args.k, args.max_new_tokens,
                                progress=not args.no_progress)
    corr = correlate.write(results, Path(args.out))
    print(correlate.format_table(results, corr))

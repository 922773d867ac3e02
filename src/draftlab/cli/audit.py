"""`draftlab audit`: check that speculative sampling keeps the target's distribution on this deployment."""

from __future__ import annotations

import json

from draftlab.cli.options import add_sampling_args, add_target_args
from draftlab.defaults import DraftSettings
from draftlab.errors import DraftlabError

DEFAULT_PROMPT = "List three colours, then three animals, then three colours again:"


def add_audit_command(sub) -> None:
    """Register `draftlab audit` on the top-level subparsers."""
    audit = sub.add_parser("audit", help="losslessness audit: speculative vs plain sampling, position by position")
    add_target_args(audit)
    audit.add_argument("--drafters", nargs="+", default=["ngram", "layers:0-3"], help="drafter specs to audit")
    audit.add_argument("--k", type=int, default=DraftSettings.k, help="draft tokens per step (>= 1)")
    add_sampling_args(audit, temperature=0.8)  # the audit is about sampling
    audit.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt every continuation starts from")
    audit.add_argument("--positions", type=int, default=3, help="tokens compared per continuation")
    audit.add_argument("--samples", type=int, default=400, help="continuations per method, at most")
    audit.add_argument("--budget", type=float, default=300.0, help="seconds for all sampling; sizes --samples")
    audit.add_argument("--alpha", type=float, default=0.01, help="family-wise level of the tests")
    audit.add_argument("--no-hf", action="store_true", help="leave out Hugging Face assisted generation")
    audit.add_argument("--json", action="store_true", help="end stdout with one JSON object")
    audit.set_defaults(run=cmd_audit)


def cmd_audit(args) -> None:
    """Run the audit, print the table (and JSON); exit status 1 when a draftlab configuration fails."""
    from draftlab.api import SpeculativeDecoder, eos_ids, encode_prompt
    from draftlab.checks.audit import AuditSettings, exact_first_distribution, format_audit, run_audit
    from draftlab.contenders.hf import hf_assist, hf_generate
    from draftlab.engine import GenerationConfig
    from draftlab.models import load_model
    from draftlab.registry import parse_drafter_spec
    from draftlab.decoding.sampling import SamplingConfig

    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    if sampling.greedy:
        raise DraftlabError("--temperature must be > 0: the audit checks sampling (greedy output is checked by bench)")
    settings = AuditSettings(args.positions, args.samples, args.budget, args.alpha)
    target = load_model(args.target, device=args.device, dtype=args.dtype, backend=args.backend)
    prompt_ids = encode_prompt(target.tokenizer, args.prompt)
    eos = eos_ids(target)
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1, backend=args.backend)

    def ours(decoder):
        return lambda seed: decoder.generate(prompt_ids, max_new_tokens=settings.positions, temperature=sampling.temperature,
                                             top_k=sampling.top_k, top_p=sampling.top_p, seed=seed).token_ids

    methods = {}
    for spec in args.drafters:
        decoder = SpeculativeDecoder.from_names(target, drafter=spec, k=args.k, backend=args.backend)
        methods[f"draftlab {spec} K={args.k}"] = ours(decoder)
        if not args.no_hf and not target.engine.runs_gguf:
            try:
                assist = hf_assist(parse_drafter_spec(spec), decoder.draft_model, args.k)
            except DraftlabError:
                continue
            methods[f"hf assisted {spec} K={args.k}"] = (
                lambda seed, assist=assist: hf_generate(
                    target, prompt_ids, GenerationConfig(settings.positions, sampling, seed, eos_token_ids=tuple(eos)),
                    assist))
    report = run_audit(ours(plain), methods, exact_first_distribution(plain.engine, prompt_ids, sampling), settings,
                       progress=print)
    print(format_audit(report))
    if args.json:
        print(json.dumps(report.to_dict()))
    if not report.passed:
        raise SystemExit(1)

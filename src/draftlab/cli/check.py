"""`draftlab check exact`: whether every row of a scored block equals the row scored alone on this device, per op
and per model shape (`draftlab.checks.exactness`)."""

from __future__ import annotations

import sys
import time

CPU_MLP_CAP = 2048  # on a CPU the MLP is narrowed to this width (its products are chunked like the rest) to fit a minute
CPU_VOCAB_CAP = 4096  # and the vocabulary (the LM head is one more chunked product) to this size


def add_check_commands(sub) -> None:
    """Register `check exact`."""
    check = sub.add_parser("check", help="check this machine: exact (row invariance per op and model shape)")
    what = check.add_subparsers(dest="check", required=True)
    exact = what.add_parser("exact", help="every row of a block equals the row scored alone, per op and shape, on "
                                          "random weights in real models' shapes (about a minute)")
    exact.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    exact.add_argument("--shape", nargs="+", metavar="NAME", help="model shapes (default: all of "
                       "smollm2-135m qwen2.5-0.5b qwen2.5-1.5b qwen2.5-7b llama-3-8b)")
    exact.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16", "fp16"),
                       help="default: fp32 bf16 fp16 on CUDA, fp32 bf16 on a CPU")
    exact.add_argument("--prefixes", nargs="+", type=int, default=[17, 300],
                       help="cached tokens before each block (default 17 300)")
    exact.add_argument("--rows", type=int, default=16, help="the exact route's row chunk R (exact-linear/R; default 16)")
    exact.add_argument("--route", default="exact-linear", choices=("exact-linear", "exact-wm"),
                       help="the exact route's products: exact-linear (the default) or weight-major exact-wm "
                            "(which `auto` picks on some devices and shapes)")
    exact.add_argument("--full-mlp", action="store_true",
                       help=f"keep the shapes' MLP width on a CPU too (default: at most {CPU_MLP_CAP} there)")
    exact.add_argument("--step", nargs="+", default=["auto"], metavar="STEP",
                       help="how the exact route runs its blocks, each checked: auto (the device's default: CUDA "
                            "graphs on a GPU, the eager step elsewhere), off (eager), rows, block, graphs, graphs-block")
    exact.set_defaults(run=cmd_check_exact)


def cmd_check_exact(args) -> None:
    """Print a line per (shape, dtype, op or block) and whether its rows are invariant; exit 1 when any differs."""
    import torch

    from draftlab.backends.routes import cpu_flags
    from draftlab.errors import DraftlabError
    from draftlab.backends.static_step import StaticStep
    from draftlab.checks.exactness import check_shape, shapes_named
    from draftlab.models import check_device

    check_device(args.device)
    if min(args.prefixes) < 1 or not 1 <= args.rows <= 64:
        raise DraftlabError("--prefixes must be >= 1 and --rows in 1..64")
    on_cuda = args.device.startswith("cuda")
    dtypes = args.dtypes or (["fp32", "bf16", "fp16"] if on_cuda else ["fp32", "bf16"])
    where = (torch.cuda.get_device_name(args.device) if on_cuda else
             f"CPU ({' '.join(sorted(f for f in cpu_flags() if f.startswith(('avx', 'amx'))))})")
    print(f"check exact: torch {torch.__version__} on {where}; random weights in each shape, "
          f"{'full' if on_cuda or args.full_mlp else f'MLP and vocabulary at most {CPU_MLP_CAP} and {CPU_VOCAB_CAP}'}, "
          f"{args.route}/{args.rows}")
    steps = {name: "auto" if name == "auto" else StaticStep.parse(name) for name in args.step}
    started, findings = time.perf_counter(), []
    for name, step in steps.items():
        print(f"check exact: step {name}")
        for shape in shapes_named(args.shape):
            shape = shape if on_cuda or args.full_mlp else shape.capped(CPU_MLP_CAP, CPU_VOCAB_CAP)
            for dtype in dtypes:
                for finding in check_shape(shape, dtype, args.device, tuple(args.prefixes), rows=args.rows, step=step,
                                           route=args.route):
                    print(finding.line(), flush=True)
                    findings.append(finding)
    bad = [f for f in findings if not f.ok]
    print(f"check exact: {'all rows invariant' if not bad else f'{len(bad)} of {len(findings)} checks DIFFER'} "
          f"({len(findings)} checks, {time.perf_counter() - started:.0f} s)")
    if bad:
        sys.exit(1)

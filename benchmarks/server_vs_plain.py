"""A llama-server command against every plain decoding draftlab can run on this host, in one measurement loop.

The command's server and, interleaved per prompt through `draftlab.measure`: the same server without its
speculative flags, llama-cpp-python's `generate`, draftlab's plain decoding on llama.cpp's exact kernels and on
its default (repacked) kernels, and draftlab's torch backend in the host's own fastest route (`auto`) and its other
dtypes' fastest routes. Prints each one's tokens/s, the command's speedup over each (end to end and decode only),
over the fastest of them, and how many outputs equal the plain server's; the last line is one JSON document.

    python benchmarks/server_vs_plain.py --command "llama-server -m qwen2.5-coder-1.5b --spec-type ngram-mod"
    python benchmarks/server_vs_plain.py --command "llama-server -m smollm2-135m --spec-type ngram-simple" --no-torch
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from draftlab.api import SpeculativeDecoder, eos_ids, prompt_ids
from draftlab.backends.routes import cpu_flags
from draftlab.files.datasets import load_prompts
from draftlab.contenders.llama_server import LlamaServer
from draftlab.contenders.llama_cpp_python import LlamaCppPeer
from draftlab.measure import DECODE, END_TO_END, EncodedPrompt, RunSettings, measure
from draftlab.models import gguf_path
from draftlab.contenders.plain import autoregressive, default_kernels, host_plain
from draftlab.contenders.serve_check import parse_command, plain_of

COMMAND, SERVER_PLAIN = "llama-server command", "llama-server plain"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--command", required=True, help="a llama-server command line, quoted")
    parser.add_argument("--target", default=None, help="draftlab's name of the model (default: the command's -m)")
    parser.add_argument("--dataset", default="code-edit")
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--no-torch", action="store_true", help="leave draftlab's torch backend out")
    args = parser.parse_args()

    config = parse_command(args.command)
    target = args.target or str(config.model)
    exact = SpeculativeDecoder.from_names(target, drafter="none", k=1, backend="llamacpp")
    contenders = {"draftlab llama.cpp exact": exact, "draftlab llama.cpp default kernels": default_kernels(exact),
                  "llama-cpp-python generate": LlamaCppPeer(gguf_path(target)).contender(eos_ids(exact.target))}
    if not args.no_torch:
        torch_plain = SpeculativeDecoder.from_names(target, drafter="none", k=1)
        contenders[f"draftlab torch {torch_plain.target_backend.numerics.split(' (')[0]}"] = autoregressive(torch_plain)
        contenders.update({f"draftlab torch {label}": plain for label, plain in host_plain(torch_plain).items()
                           if not label.startswith("llama.cpp")})
    prompts = [EncodedPrompt(p.id, p.category, prompt_ids(exact.target.tokenizer, p))
               for p in load_prompts(args.dataset, args.limit)]
    context = config.context // config.slots
    with tempfile.TemporaryDirectory() as logs, LlamaServer(plain_of(config), Path(logs)) as plain_server, \
            LlamaServer(config, Path(logs)) as server:
        contenders[SERVER_PLAIN] = plain_server.contender(context)
        contenders[COMMAND] = server.contender(context)
        measured = measure(contenders, prompts, RunSettings(args.max_new_tokens), warmup=1, progress="measure")
    plains = [key for key in contenders if key != COMMAND]
    speeds = {key: measured.tokens_per_s(key, END_TO_END) for key in contenders}
    fastest = max(plains, key=lambda key: speeds[key])
    identical = sum(a.token_ids == b.token_ids for a, b in zip(measured.records[COMMAND], measured.records[SERVER_PLAIN]))
    print(f"{args.command}; {len(prompts)} {args.dataset} prompts, {args.max_new_tokens} new tokens")
    print(f"{'plain decoding':<44}{'tok/s':>8}{'command over it':>17}{'decode only':>13}")
    rows = {}
    for key in plains:
        end, decode = measured.speedup(COMMAND, key, END_TO_END), measured.speedup(COMMAND, key, DECODE)
        rows[key] = {"tokens_per_s": speeds[key], "speedup": end, "decode_speedup": decode}
        print(f"{key:<44}{speeds[key]:>8.1f}{end:>16.2f}x{(f'{decode:.2f}x' if decode else '-'):>13}")
    print(f"{COMMAND:<44}{speeds[COMMAND]:>8.1f}")
    print(f"fastest plain decoding here: {fastest}; the command is {rows[fastest]['speedup']:.2f}x it end to end; "
          f"{identical}/{len(prompts)} outputs equal the plain server's")
    print(f"command: python {' '.join(sys.argv)}")
    print(f"host CPU flags: {' '.join(sorted(f for f in cpu_flags() if f.startswith(('avx', 'amx'))))}")
    print(json.dumps({"command": args.command, "plain": rows, "command_tokens_per_s": speeds[COMMAND],
                      "fastest_plain": fastest, "identical": identical, "prompts": len(prompts),
                      "cpu_flags": sorted(cpu_flags())}))


if __name__ == "__main__":
    main()

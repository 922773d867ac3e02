"""draftlab serve against llama-server, both started here on 127.0.0.1, at 1, 4, 8 and 16 requests in flight, in one run.

Servers of `--slots` slots (levels above it queue), one at a time (none runs beside another), a fresh server per set
and level (so no server answers a prompt twice: a drafter that learns across requests would know the answer), every prompt
prefilled whole (llama-server's `cache_prompt` and draftlab serve's prompt cache off):
llama-server's plain decoding and its own speculation (each type at the pick's length), draftlab serve's plain
decoding, `--k auto` with the pick's drafter, and its pick (a drafter and K per requests in flight). Each serves the
same prompt sets in windows of c requests at once (every request prefills), greedy, each request streamed. Per
server, level and set: aggregate tokens/s (every request's tokens over the windows' wall time), mean time to first
token and latency per request (from sending it), and how many outputs equal draftlab's plain decoding (`draftlab
generate`, in this process); for draftlab serve with a draft model, its passes over the draft's weights against the
steps' draft positions (each step's deepest draft) in that window, from its /metrics. The host's CPU flags are printed
with the figures; the last line is one JSON document.

`--chats N`: then N conversations of 4 turns through `/v1/chat/completions` (a long-context document and its
question, then three follow-ups), each turn resending the earlier turns and answers, greedy, one conversation at a
time, on draftlab serve's pick with its prompt cache and without (fresh servers): time to first token per turn, and
whether every answer is the same with the cache as without.

`--soak S`: then 16 clients send requests to draftlab serve's pick for S seconds (each at most 64 tokens, at most
--soak-requests in all), counting answers, 429s, other errors and requests lost, and the server's memory before
and after.

    python benchmarks/serve.py --repeat 3                        # SmolLM2 pure Q4_0, quick, code edits, long context
    python benchmarks/serve.py --pick suffix --k-per-load 1-2:6,3-4:4 --soak 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from draftlab.api import SpeculativeDecoder, prompt_ids
from draftlab.backends.routes import cpu_flags
from draftlab.study.run.budget import HOST_FLAGS
from draftlab.contenders.draftlab_serve import SERVED_NAME, DraftlabServer, ServeConfig
from draftlab.contenders.llama_server import LlamaServer
from draftlab.contenders.server_configs import spec_config
from draftlab.errors import DraftlabError
from draftlab.files.datasets import load_prompts
from draftlab.measure import RunSettings
from draftlab.models import gguf_path

CONTEXT = 4096  # per slot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m@Q4_0_PURE")
    parser.add_argument("--datasets", default="heldout,code-edit,long-context")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=1, help="runs of everything, in turns: each figure's median "
                                                              "and range")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--levels", default="1,4,8,16")
    parser.add_argument("--slots", type=int, default=4, help="every server's slots (requests decoded at once)")
    parser.add_argument("--pick", default="suffix", help="draftlab serve's drafter")
    parser.add_argument("--k-per-load", default="1-4:6", help="its K per requests in flight")
    parser.add_argument("--server-types", default="ngram-simple,ngram-mod", help="llama-server's own, at the pick's K")
    parser.add_argument("--chats", type=int, default=0, metavar="N", help="multi-turn conversations, with and "
                                                                            "without the prompt cache")
    parser.add_argument("--soak", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--soak-requests", type=int, default=2000)
    args = parser.parse_args()

    levels = [int(c) for c in args.levels.split(",")]
    slots = args.slots
    k = int(args.k_per_load.split(",")[0].split(":")[1])
    reference = SpeculativeDecoder.from_names(args.target, drafter="none", k=1, backend="llamacpp")
    sets = {name: [prompt_ids(reference.target.tokenizer, p) for p in load_prompts(name, args.limit)]
            for name in filter(None, args.datasets.split(","))}  # '': the chats (or the soak) only
    plain = {name: [reference.generate(ids, max_new_tokens=args.max_new_tokens, temperature=0).token_ids
                    for ids in prompts] for name, prompts in sets.items()}
    model = gguf_path(args.target)
    servers = {"llama-server plain": (lambda logs: LlamaServer(spec_config(model, "none", 0, slots), logs), LLAMA)}
    for spec_type in filter(None, args.server_types.split(",")):
        servers[f"llama-server {spec_type} K={k}"] = (
            lambda logs, t=spec_type: LlamaServer(spec_config(model, t, k, slots), logs), LLAMA)
    servers["draftlab serve plain"] = (lambda logs: DraftlabServer(
        ServeConfig(args.target, "none", "1:0", slots, CONTEXT, prompt_cache=False), logs), DRAFTLAB)
    servers[f"draftlab serve {args.pick} auto"] = (lambda logs: DraftlabServer(
        ServeConfig(args.target, args.pick, "auto", slots, CONTEXT, prompt_cache=False), logs), DRAFTLAB)
    servers[f"draftlab serve {args.pick} {args.k_per_load}"] = (lambda logs: DraftlabServer(
        ServeConfig(args.target, args.pick, args.k_per_load, slots, CONTEXT, prompt_cache=False), logs), DRAFTLAB)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeat):
            for name, (make, protocol) in servers.items():
                for dataset, prompts in sets.items():
                    for level in levels:
                        with make(Path(scratch)) as server:  # fresh: it has answered none of these prompts
                            run = server.contender(CONTEXT, reuse=False)
                            run.run([1, 2, 3], RunSettings(8, temperature=0.0))  # warm-up, on no prompt of a set
                            stream = Streamed(server.port, protocol, args.max_new_tokens)
                            before = _draft_counts(server.port) if protocol is DRAFTLAB else {}
                            rows.append({"server": name, "dataset": dataset, "level": level, "repeat": repeat,
                                         **_windows(stream, prompts, plain[dataset], level)})
                            if before:
                                after = _draft_counts(server.port)
                                rows[-1].update({key: after[key] - before[key] for key in before})
                        print(_row(rows[-1]), flush=True)
        chats = _chats(args, Path(scratch)) if args.chats else None
        soak = _soak(servers, sets, args, Path(scratch)) if args.soak else None
    print(_table(rows))
    if chats:
        print(_chat_table(chats))
    flags = " ".join(sorted(cpu_flags() & set(HOST_FLAGS)))
    print(f"soak: {soak}" if soak else "soak: not run")
    print(f"host CPU flags: {flags}")
    print(json.dumps({"target": args.target, "flags": flags, "rows": rows, "chats": chats, "soak": soak}))


# How each server streams a greedy completion of token ids: (path, body's fields, a chunk's tokens, the end's mark)
LLAMA = ("/completion", lambda ids, n: {"prompt": ids, "n_predict": n, "temperature": 0.0, "cache_prompt": False,
                                        "return_tokens": True, "stream": True},
         lambda chunk: chunk.get("tokens") or [])
DRAFTLAB = ("/v1/completions", lambda ids, n: {"model": SERVED_NAME, "prompt": ids, "max_tokens": n, "temperature": 0,
                                               "return_token_ids": True, "stream": True},
            lambda chunk: [t for c in chunk.get("choices") or [] for t in c.get("token_ids") or []])


class Streamed:
    """Greedy completions streamed from one server: each request's tokens, time to first token and latency."""

    def __init__(self, port: int, protocol: tuple, max_new_tokens: int) -> None:
        self.url, self.body, self.tokens_of = f"http://127.0.0.1:{port}{protocol[0]}", protocol[1], protocol[2]
        self.max_new_tokens = max_new_tokens

    def request(self, ids: list[int]) -> tuple[list[int], float, float]:
        """(tokens, seconds to the first chunk that carries tokens, seconds to the last)."""
        data = json.dumps(self.body(list(ids), self.max_new_tokens)).encode()
        request = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"})
        tokens, first, began = [], None, time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            for line in response:
                text = line.decode().strip()
                if not text.startswith("data: ") or text == "data: [DONE]":
                    continue
                new = self.tokens_of(json.loads(text[len("data: "):]))
                if new and first is None:
                    first = time.perf_counter() - began
                tokens += new
        return tokens, first if first is not None else time.perf_counter() - began, time.perf_counter() - began


def _windows(stream: Streamed, prompts: list[list[int]], plain: list[list[int]], level: int) -> dict:
    """The prompts in windows of `level` requests at once: aggregate tok/s, time to first token, latency, outputs
    equal to plain."""
    tokens, wall, firsts, latencies, identical = 0, 0.0, [], [], 0
    with ThreadPoolExecutor(level) as pool:
        for start in range(0, len(prompts), level):
            window = list(range(start, min(start + level, len(prompts))))
            began = time.perf_counter()
            results = list(pool.map(stream.request, [prompts[i] for i in window]))
            wall += time.perf_counter() - began
            for i, (answer, first, seconds) in zip(window, results):
                tokens += len(answer)
                firsts.append(first)
                latencies.append(seconds)
                identical += answer == plain[i]
    return {"tokens_per_s": tokens / wall, "ttft_s": statistics.mean(firsts), "latency_s": statistics.mean(latencies),
            "identical": identical, "prompts": len(prompts)}


def _draft_counts(port: int) -> dict:
    """A draftlab server's draft passes and draft positions so far ({} where it serves no draft model)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith(("draftlab:draft_passes_total ", "draftlab:draft_positions_total "))}
    if "draftlab:draft_passes_total" not in values:
        return {}
    return {"draft_passes": values["draftlab:draft_passes_total"],
            "draft_positions": values["draftlab:draft_positions_total"]}


FOLLOW_UPS = ("Summarize your answer in one sentence.", "What detail of the document matters most, and why?",
              "Give the document a short title.")


def _chats(args, logs: Path) -> dict:
    """`--chats` conversations on draftlab serve's pick, with the prompt cache and without (a fresh server each):
    per turn, the mean time to first token; the answers of both, which must be the same."""
    documents = load_prompts("long-context", args.chats)
    out = {}
    for cached in (True, False):
        config = ServeConfig(args.target, args.pick, args.k_per_load, 1, CONTEXT, prompt_cache=cached)
        with DraftlabServer(config, logs) as server:
            turns = [_conversation(server.port, [d.text, *FOLLOW_UPS], args.max_new_tokens) for d in documents]
        out["cache" if cached else "no cache"] = turns
    return out


def _conversation(port: int, questions: list[str], max_tokens: int) -> list[dict]:
    """One conversation, a turn per question, each resending every earlier turn: per turn its prompt's tokens, time to
    first token, and answer."""
    messages, turns = [], []
    for question in questions:
        messages.append({"role": "user", "content": question})
        body = {"model": SERVED_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        text, first, prompt_tokens, began = "", None, 0, time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            for line in response:
                data = line.decode().strip()
                if not data.startswith("data: ") or data == "data: [DONE]":
                    continue
                event = json.loads(data[len("data: "):])
                for choice in event.get("choices") or []:
                    if choice["delta"].get("content") and first is None:
                        first = time.perf_counter() - began
                    text += choice["delta"].get("content") or ""
                prompt_tokens = (event.get("usage") or {}).get("prompt_tokens", prompt_tokens)
        turns.append({"prompt_tokens": prompt_tokens, "ttft_s": first or time.perf_counter() - began, "answer": text})
        messages.append({"role": "assistant", "content": text})
    return turns


def _chat_table(chats: dict) -> str:
    """Per turn: prompt tokens, mean time to first token with the cache and without, their ratio, answers the same."""
    lines = [f"{'turn':>4}{'prompt tokens':>15}{'ttft cache s':>14}{'ttft no cache s':>17}{'ratio':>8}{'same':>7}"]
    on, off = chats["cache"], chats["no cache"]
    for turn in range(len(on[0])):
        ttft_on = statistics.mean(c[turn]["ttft_s"] for c in on)
        ttft_off = statistics.mean(c[turn]["ttft_s"] for c in off)
        same = sum(a[turn]["answer"] == b[turn]["answer"] for a, b in zip(on, off))
        tokens = statistics.mean(c[turn]["prompt_tokens"] for c in on)
        lines.append(f"{turn + 1:>4}{tokens:>15.0f}{ttft_on:>14.3f}{ttft_off:>17.3f}{ttft_on / ttft_off:>8.2f}"
                     f"{same:>5}/{len(on)}")
    return "\n".join(lines)


def _soak(servers, sets, args, logs: Path) -> dict:
    """16 clients against draftlab serve's pick for `--soak` seconds: answers, 429s, errors, lost, memory."""
    name = list(servers)[-1]
    prompts = [ids for prompts in sets.values() for ids in prompts]
    counts = {"ok": 0, "429": 0, "error": 0, "lost": 0}
    deadline = time.monotonic() + args.soak
    sent = iter(range(args.soak_requests))
    with servers[name][0](logs) as server:
        before = server.memory_gib()

        def client(seed: int) -> None:
            for n in sent:
                if time.monotonic() > deadline:
                    return
                try:
                    answer = server.completion(prompts[(seed + n) % len(prompts)], RunSettings(64, temperature=0.7,
                                                                                               seed=n))
                    counts["ok" if answer["choices"][0]["token_ids"] else "lost"] += 1
                except DraftlabError as exc:
                    counts["429" if "(429)" in str(exc) else "error"] += 1

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(client, range(16)))
        after = server.memory_gib()
    return {"server": name, "seconds": args.soak, **counts, "memory_gib_before": round(before, 3),
            "memory_gib_after": round(after, 3)}


def _row(row: dict) -> str:
    passes = (f"  draft passes {row['draft_passes']:.0f} for {row['draft_positions']:.0f} positions"
              if "draft_passes" in row else "")
    return (f"{row['server']:<40}{row['dataset']:<13}{row['level']:>3}{row['tokens_per_s']:>9.1f}"
            f"{row['ttft_s']:>8.2f}{row['latency_s']:>9.2f}{row['identical']:>4}/{row['prompts']}{passes}")


def _table(rows: list[dict]) -> str:
    """Per server, set and level over the repeats: median tok/s (range), median time to first token and latency,
    outputs equal to plain, the median's ratio to llama-server's plain decoding and to draftlab serve's plain at the
    same set and level, and a draft model's passes against its draft positions."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["server"], r["dataset"], r["level"]), []).append(r)
    median = {key: statistics.median(r["tokens_per_s"] for r in runs) for key, runs in groups.items()}
    lines = [f"{'server':<40}{'set':<13}{'c':>3}{'tok/s':>8}{'range':>15}{'ttft s':>7}{'lat s':>7}{'same':>8}"
             "  x llama plain  "
             "x draftlab plain"]
    for (server, dataset, level), runs in sorted(groups.items(), key=lambda g: (g[0][1], g[0][2], -median[g[0]])):
        tps = [r["tokens_per_s"] for r in runs]
        same = sum(r["identical"] for r in runs)
        llama = median.get(("llama-server plain", dataset, level))
        own = median.get(("draftlab serve plain", dataset, level))
        lines.append(f"{server:<40}{dataset:<13}{level:>3}{median[(server, dataset, level)]:>8.1f}"
                     f"{f'{min(tps):.1f}-{max(tps):.1f}':>15}{statistics.median(r['ttft_s'] for r in runs):>7.2f}"
                     f"{statistics.median(r['latency_s'] for r in runs):>7.2f}"
                     f"{same:>4}/{sum(r['prompts'] for r in runs):<3}"
                     f"  {median[(server, dataset, level)] / llama if llama else 0:>6.2f}x"
                     f"  {median[(server, dataset, level)] / own if own else 0:>12.2f}x"
                     + _passes(runs))
    return "\n".join(lines)


def _passes(runs: list[dict]) -> str:
    """A draft model's passes over its weights against the steps' draft positions, over the repeats ('' where none)."""
    if not any("draft_passes" in r for r in runs):
        return ""
    return (f"  draft passes {sum(r['draft_passes'] for r in runs):.0f} / positions "
            f"{sum(r['draft_positions'] for r in runs):.0f}")


if __name__ == "__main__":
    main()

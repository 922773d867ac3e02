"""The configuration draftlab chose, in the syntax of the engine a user deploys: vLLM, SGLang or llama-server.

`export(choice, engine)` turns a `Deployable` (the target, a draftlab drafter spec or one of llama-server's own
types, K, and where a study measured several batch sizes the K per batch size) into one command line:

- vLLM: `vllm serve MODEL --speculative-config '{...}'` (`method` ngram, suffix, draft_model or eagle3, with
  `num_speculative_tokens` and, from a study at several batch sizes, `num_speculative_tokens_per_batch_size`
  as `[[lo, hi, K], ...]`; K 0 there means no speculation at those batch sizes);
- SGLang: `python -m sglang.launch_server --model-path MODEL --speculative-algorithm NGRAM|STANDALONE|EAGLE3 ...` with
  `--speculative-num-steps K --speculative-eagle-topk 1 --speculative-num-draft-tokens K+1` (a chain; a static
  tree `tree:BxB:model:...` gives topk B and its node count);
- llama-server: `llama-server -m MODEL.gguf --spec-type ... --spec-draft-n-max K`.

An EAGLE-3 draft (`eagle3`, `model:DIR` of one, trees of it) exports as the files `draftlab design eagle3` writes
in its `--out` (`eagle3_files`): the engines' checkpoint for vLLM and SGLang, the GGUF for llama-server (for the
shipped draft, `draftlab design eagle3 --from eagle3 --out eagle3-TARGET --gguf` writes them).

Where an engine has no counterpart (a feature draft before it is exported as EAGLE-3, draftlab's layer
self-drafts, staged drafting, token trees on llama-server, suffix trees on SGLang) the export says so in one line
(`DraftlabError`) instead of printing a command that would do something else. Every mapping is the nearest the
engine documents, not a promise of the same acceptance: the engines' n-gram lookups differ in their details.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from draftlab.backends.engines import LLAMA_SERVER, SERVED, SGLANG, VLLM
from draftlab.errors import DraftlabError
from draftlab.drafters.eagle3 import is_eagle3_draft
from draftlab.drafters.eagle3_checkpoint import engine_files
from draftlab.drafters.eagle3_checkpoint import is_checkpoint
from draftlab.drafters.files import draft_format
from draftlab.files.assets import MODEL_ASSETS, cache_dir, cached_path
from draftlab.backends.quantize import derived_path
from draftlab.drafters.model_spec import gguf_draft
from draftlab.models import split_weight_type
from draftlab.drafters.kinds import is_plain_drafter
from draftlab.registry import parse_drafter_spec

EXPORT_ENGINES = tuple(e.name for e in SERVED)  # what `--export` takes
# llama-server's speculative types (`--spec-type`): what its exports name, and what the study starts it with
SPEC_TYPES = ("draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark", "ngram-simple",
              "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
NGRAM_MOD_MIN_SHARE = 0.75  # ngram-mod's --spec-ngram-mod-n-min as a share of its -n-max (the server's 48 of 64)
HF_REPOS = {  # the embedded models' names on the Hugging Face hub, as vLLM and SGLang load them
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "gemma3-270m": "google/gemma-3-270m",
    "qwen2.5-coder-1.5b": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
    "qwen2.5-coder-0.5b": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
}


@dataclass(frozen=True)
class Deployable:
    """What draftlab chose: the target, the draft (a draftlab drafter spec such as 'ngram:2-4' or 'model:NAME', or a
    llama-server type such as 'ngram-mod' or 'draft-simple/NAME'; 'none' for plain decoding) and K."""

    target: str
    draft: str
    k: int
    per_batch_size: tuple[tuple[int, int, int], ...] = ()  # (lo, hi, K) per run of batch sizes, from a study

    def __post_init__(self) -> None:
        if self.k < 0:
            raise DraftlabError(f"K must be >= 0, got {self.k}")
        for lo, hi, k in self.per_batch_size:
            if not 1 <= lo <= hi or k < -1:
                raise DraftlabError(f"bad per-batch-size row {[lo, hi, k]}: 1 <= lo <= hi and K >= -1")


def per_batch_size(pays: Sequence[tuple[int, bool]], k: int) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size` from (concurrency, whether speculation pays there), in rising
    concurrency: a row [lo, hi, K] per run of levels, K where it pays and 0 where not (-1 as K: the type's default)."""
    table: list[list[int]] = []
    for concurrency, paying in pays:
        level_k = k if paying else 0
        if table and table[-1][2] == level_k:
            table[-1][1] = concurrency
        else:
            table.append([table[-1][1] + 1 if table else 1, concurrency, level_k])
    return table


def export(choice: Deployable, engine: str) -> str:
    """The command that runs `choice` on `engine` (one of EXPORT_ENGINES); a one-line error where it has no counterpart."""
    if engine not in EXPORT_ENGINES:
        raise DraftlabError(f"unknown engine {engine!r} to export to; use one of {', '.join(EXPORT_ENGINES)}")
    return {VLLM.name: vllm_command, SGLANG.name: sglang_command, LLAMA_SERVER.name: llama_server_command}[engine](choice)


def hf_model(source: str) -> str:
    """The model as vLLM and SGLang name it: the hub id of an embedded model, else the path given."""
    return HF_REPOS.get(source, source)


def vllm_config(choice: Deployable, model_path: Callable[[str], str] = hf_model,
                eagle3_path: Callable[[str, str], str] = lambda draft, target: eagle3_files(draft, target)[0]
                ) -> dict | None:
    """vLLM's `speculative_config` for the choice (None: plain decoding); `model_path`: how vLLM finds a draft
    model by its name (the hub id of an embedded one; a study gives its local directory); `eagle3_path`: where an
    EAGLE-3 draft's engines' checkpoint lies, by (draft directory, '' for the shipped one; target)."""
    kind, arg = _draft_kind(choice.draft, VLLM.name)
    if kind == "none":
        return None
    if kind == "ngram":
        low, high = arg
        config = {"method": "ngram", "num_speculative_tokens": choice.k or 4, "prompt_lookup_max": high,
                  "prompt_lookup_min": low}
    elif kind == "suffix":
        config = {"method": "suffix", "num_speculative_tokens": choice.k or 32}
    elif kind == "model":
        config = {"method": "draft_model", "model": model_path(arg), "num_speculative_tokens": choice.k or 4}
    elif kind == "eagle3":
        config = {"method": "eagle3", "model": eagle3_path(arg, choice.target),
                  "num_speculative_tokens": choice.k or 3}
    else:
        raise _no_counterpart(choice.draft, "vLLM", kind, arg)
    if choice.per_batch_size:
        config["num_speculative_tokens_per_batch_size"] = [
            [lo, hi, config["num_speculative_tokens"] if k == -1 else k] for lo, hi, k in choice.per_batch_size]
    return config


def vllm_command(choice: Deployable) -> str:
    """`vllm serve MODEL [--speculative-config JSON]`."""
    config = vllm_config(choice)
    words = ["vllm", "serve", hf_model(choice.target)]
    if config is not None:
        words += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    return shlex.join(words)


def sglang_flags(choice: Deployable) -> list[str]:
    """SGLang's `--speculative-*` flags for the choice ([] for plain decoding)."""
    kind, arg = _draft_kind(choice.draft, SGLANG.name)
    k = choice.k or 4
    chain = ["--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
             "--speculative-num-draft-tokens", str(k + 1)]
    if kind == "none":
        return []
    if kind == "ngram":
        low, high = arg
        return ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(k + 1),
                "--speculative-ngram-min-match-window-size", str(low),
                "--speculative-ngram-max-match-window-size", str(high)]
    if kind == "model":
        return ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", hf_model(arg), *chain]
    if kind == "eagle3":
        return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                eagle3_files(arg, choice.target)[0], *chain]
    if kind in ("tree-model", "tree-eagle3"):
        branching, model = arg
        algorithm, path = (("STANDALONE", hf_model(model)) if kind == "tree-model"
                           else ("EAGLE3", eagle3_files(model, choice.target)[0]))
        nodes = _static_tree_nodes(branching, k)
        return ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", path,
                "--speculative-num-steps", str(k), "--speculative-eagle-topk", str(max(branching)),
                "--speculative-num-draft-tokens", str(nodes + 1)]
    raise _no_counterpart(choice.draft, "SGLang", kind, arg)


def sglang_command(choice: Deployable) -> str:
    """`python -m sglang.launch_server --model-path MODEL [--speculative-* ...]`."""
    words = ["python", "-m", "sglang.launch_server", "--model-path", hf_model(choice.target), *sglang_flags(choice)]
    return shlex.join(words)


def llama_server_flags(choice: Deployable) -> list[str]:
    """llama-server's `--spec-*` flags for the choice ([] for plain decoding)."""
    kind, arg = _draft_kind(choice.draft, LLAMA_SERVER.name)
    length = ["--spec-draft-n-max", str(choice.k)] if choice.k else []
    if kind == "none":
        return []
    if kind == "ngram":
        _, high = arg
        return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(high),
                "--spec-ngram-simple-size-m", str(choice.k or 48), *length]
    if kind == "model":
        return ["--spec-type", "draft-simple", "-md", _gguf(gguf_draft(arg)), *length]  # the file draftlab drafts from
    if kind == "eagle3":
        return ["--spec-type", "draft-eagle3", "-md", eagle3_files(arg, choice.target)[1], *length]
    if kind == "server":
        types, _, rest = choice.draft.partition("/")
        draft, _, p_min = rest.partition(",p=")
        n_max, extra = length_flags(types, choice.k)
        return [*(["-md", _gguf(draft)] if draft else []), "--spec-type", types,
                *(["--spec-draft-n-max", str(n_max)] if n_max else []), *extra,
                *(["--spec-draft-p-min", p_min] if p_min else [])]
    raise _no_counterpart(choice.draft, LLAMA_SERVER.name, kind, arg)


def llama_server_command(choice: Deployable) -> str:
    """`llama-server -m MODEL.gguf [--spec-* ...]`."""
    return shlex.join(["llama-server", "-m", _gguf(choice.target), *llama_server_flags(choice)])


def length_flags(spec_type: str, k: int) -> tuple[int | None, tuple[str, ...]]:
    """llama-server's (--spec-draft-n-max, other flags) for length K of a type (K 0: none, the server's defaults)."""
    if not k:
        return None, ()
    types = spec_type.split(",")
    if types == ["ngram-mod"]:
        low = max(1, int(k * NGRAM_MOD_MIN_SHARE))
        return None, ("--spec-ngram-mod-n-max", str(k), "--spec-ngram-mod-n-min", str(low))
    return k, ()


def _draft_kind(draft: str, engine: str) -> tuple[str, object]:
    """(kind, its argument): none, ngram (low, high), suffix, model (name), tree-model ((branching), name),
    server (a llama-server type; on other engines only its draft-simple, as a draft model), or other (why not)."""
    if is_plain_drafter(draft):
        return "none", None
    head, _, model = draft.partition("/")
    if all(t in SPEC_TYPES for t in head.split(",")):
        if engine == LLAMA_SERVER.name:
            return "server", draft
        if head == "draft-eagle3":  # its GGUF lies in the draft directory beside the engines' checkpoint
            return "eagle3", str(Path(model).parent) if model.endswith(".gguf") else model
        return ("model", model.split(",p=")[0]) if head == "draft-simple" else ("server", draft)
    plan = parse_drafter_spec(draft)
    if plan.kind == "ngram":
        return "ngram", plan.ngram
    if _eagle3_dir(plan) is not None:
        return "eagle3", _eagle3_dir(plan)
    if plan.kind == "tree" and _eagle3_dir(plan.inner) is not None and not plan.tree.expand:
        return "tree-eagle3", (plan.tree.branching, _eagle3_dir(plan.inner))
    if plan.kind == "suffix":
        return "suffix", None
    if plan.kind == "model" and _is_plain_model(plan.model):
        return "model", plan.model
    if plan.kind == "tree" and plan.inner.kind == "model" and _is_plain_model(plan.inner.model) \
            and not plan.tree.expand:
        return "tree-model", (plan.tree.branching, plan.inner.model)
    return "other", plan.kind


def _eagle3_dir(plan) -> str | None:
    """The directory of an EAGLE-3 draft spec ('' for the shipped `eagle3`); None for other drafts."""
    if plan.kind == "eagle3":
        return ""
    if plan.kind == "model" and (is_eagle3_draft(plan.model) or is_checkpoint(plan.model)):
        return plan.model
    return None


def eagle3_files(directory: str, target: str) -> tuple[str, str]:
    """(engines' checkpoint directory, GGUF) of an EAGLE-3 draft: an engines' checkpoint is itself; a draft directory
    holds both once `draftlab design eagle3` wrote them; the shipped draft's ('') go to `eagle3-TARGET`."""
    checkpoint, gguf = engine_files(Path(directory or f"eagle3-{target}"))
    return str(checkpoint), str(gguf)


def _is_plain_model(model: str) -> bool:
    """True for a stand-alone draft model (not a draft directory of draftlab's own formats)."""
    return draft_format(model) is None


def _static_tree_nodes(branching: tuple[int, ...], depth: int) -> int:
    """Nodes of a static tree of `depth` levels (branching per level, then chains)."""
    nodes, width = 0, 1
    for level in range(depth):
        width *= branching[level] if level < len(branching) else 1
        nodes += width
    return nodes


def _gguf(source: str) -> str:
    """A GGUF for llama-server: the embedded model's cached file, a .gguf path as given, an EAGLE-3 draft directory's
    GGUF, either in another weight type (NAME@Q4_0_PURE: the file draftlab derives, where its source is here), else a
    placeholder."""
    base, weight_type = split_weight_type(source)
    if weight_type is not None:
        base_file = Path(_gguf(base))
        return (str(derived_path(base_file, weight_type, cache_dir())) if base_file.is_file()
                else f"{base_file.stem}.{weight_type}.gguf")
    if source.endswith(".gguf"):
        return source
    if Path(source).is_dir():
        return str(engine_files(Path(source))[1])
    if source in MODEL_ASSETS:
        return str(cached_path(MODEL_ASSETS[source]))  # where draftlab keeps it (never fetched here)
    return f"{Path(source).name}.gguf"


def _no_counterpart(draft: str, engine: str, kind: str, arg: object) -> DraftlabError:
    """Why `engine` cannot run `draft`, in one line."""
    reasons = {
        "designed": "the designed feature draft reads the target's final hidden state (the engines run EAGLE-3 drafts: "
                    "`eagle3`)",
        "layers": "a layer self-draft (save it as a model to use it there)",
        "staged": "staged drafting (the inner draft alone drafts the same greedy tokens)",
        "merged": "an n-gram guide merged into a tree",
        "adapt": "online adaptation of a feature draft",
        "tree": "this token tree",
        "tree-model": "token trees of a draft model (vLLM verifies trees only for its EAGLE drafts; llama-server "
                      "drafts chains)",
        "tree-eagle3": "a token tree of an EAGLE-3 draft (llama-server drafts chains; export the chain for vLLM, whose "
                       "tree option is experimental)",
        "suffix": "suffix decoding",
        "model": "a draft directory of draftlab's own formats (decoder heads, a pruned or cut draft)",
        "server": "llama-server's own n-gram types (draftlab's `ngram` maps to its n-gram lookup)",
    }
    why = reasons[str(arg) if kind == "other" else kind]
    return DraftlabError(f"{engine} has no counterpart of {draft!r}: {why}; export another configuration")

"""Suffix decoding (Oliaro et al., NeurIPS 2025; vLLM's `suffix` method): draft from suffix trees.

The one adapter between Arctic Inference's `SuffixDecodingCache` (the library vLLM runs, so what draftlab
measures for `suffix` carries over to a vLLM deployment) and the drafter contract. Each step matches the
newest committed tokens in two suffix trees, the request's own (its prompt and what it has generated so far)
and a cross-request one (the responses of earlier requests), and proposes the better-scoring continuation: a
chain, or a tree pruned by estimated probability. Its length follows the match: at most
`factor x match length + offset` tokens, at most K and at most the tree depth. A short match speculates little,
a long copy a lot, so block rows are not wasted where nothing repeats.

Lossless: the proposal is a function of the committed tokens (no sampling), so its draft distribution is one-hot
at each proposed token; the verifier treats look-up drafts exactly so (`Proposal.draft_probs` None), under greedy
decoding and sampling alike. The library's "probabilities" are frequencies in the trees, used only to prune.

Memory across requests: a `SuffixCache` holds the responses of finished requests (FIFO, bounded), shared by
every generation that uses the drafter: a bench run, a sweep cell, an API decoder kept between `generate`
calls. With a directory it is loaded from it and each finished response is appended to it, so a deployment
keeps what it learned.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from draftlab.drafters.base import BlindDrafter
from draftlab.errors import DraftlabError
from draftlab.files.safeio import write_atomic
from draftlab.decoding.step import ROOT, Proposal, chain_parents

LIBRARY = "arctic-inference==0.3.0"
INSTALL_HINT = (f"--drafter suffix needs {LIBRARY} (Arctic Inference's suffix trees, as vLLM runs them): "
                "run ./run.sh --setup-only, or see docs/engine-and-drafters.md#suffix-decoding")
STORE_FORMAT = "draftlab-suffix-cache/1"
LOCK_FILE = "suffix-cache.lock"  # flock'ed by each writer
MAX_TOKEN_ID = 2**31 - 1  # the suffix trees hold int32 ids
RESPONSES_FILE = "responses.jsonl"
META_FILE = "suffix-cache.json"


@dataclass(frozen=True)
class SuffixOptions:
    """The spec string's options (`suffix:depth=24,factor=1,offset=0,min_prob=0.1,tree,responses=10000,cache=DIR`).

    Defaults are vLLM's (`suffix_decoding_*`); K (`--k`) is the most tokens one step may propose."""

    depth: int = 24  # longest match and speculation the trees hold (vLLM's suffix_decoding_max_tree_depth)
    factor: float = 1.0  # speculate at most factor x match length + offset tokens
    offset: float = 0.0
    min_prob: float = 0.1  # prune continuations whose estimated probability falls below this
    tree: bool = False  # propose a tree of continuations instead of one chain (vLLM runs chains)
    responses: int = 10000  # earlier responses held across requests (FIFO); 0: none, every request starts cold
    cache: str = ""  # a directory: load the held responses from it and append each new one

    def __post_init__(self) -> None:
        if self.depth < 1 or self.responses < 0 or self.factor < 0 or not 0 <= self.min_prob <= 1:
            raise DraftlabError("suffix options need depth >= 1, responses >= 0, factor >= 0 and 0 <= min_prob <= 1")

    @classmethod
    def parse(cls, text: str) -> "SuffixOptions":
        """'depth=32,tree,cache=runs/suffix' -> options; '' -> the defaults."""
        fields: dict = {}
        for item in filter(None, text.split(",")):
            key, eq, value = item.partition("=")
            if key in ("tree", "chain") and not eq:
                fields["tree"] = key == "tree"
            elif key in ("depth", "responses") and eq:
                fields[key] = _number(int, key, value)
            elif key in ("factor", "offset", "min_prob") and eq:
                fields[key] = _number(float, key, value)
            elif key == "cache" and value:
                fields["cache"] = value
            else:
                raise DraftlabError(f"unknown suffix option {item!r}: use depth=N, factor=F, offset=F, min_prob=P, "
                                    "tree or chain, responses=N, cache=DIR")
        return cls(**fields)


def _number(kind: type, key: str, value: str):
    try:
        return kind(value)
    except ValueError as exc:
        raise DraftlabError(f"suffix option {key} needs a number, got {value!r}") from exc


def library():
    """Arctic Inference's cache class, or a one-line error naming what to install."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except Exception as exc:  # missing, or a build that does not load (a broken native extension)
        raise DraftlabError(f"{INSTALL_HINT} ({type(exc).__name__}: {exc})") from None
    return SuffixDecodingCache


def available() -> bool:
    """Whether `--drafter suffix` can run here."""
    try:
        library()
    except DraftlabError:
        return False
    return True


class SuffixCache:
    """The suffix trees: one per active request (its prompt and response) and one over earlier responses."""

    def __init__(self, depth: int = SuffixOptions.depth, responses: int = SuffixOptions.responses,
                 store: str | os.PathLike = "", tokenizer_id: str = "") -> None:
        """responses: how many earlier responses are held (0: none); store: a directory to load from and append
        each finished response to; tokenizer_id: what the token ids mean (a store written with another tokenizer
        is refused)."""
        self.depth, self.responses = depth, responses
        self._trees = library()(max_tree_depth=depth, max_cached_requests=responses)
        self._held: deque[list[int]] = deque(maxlen=responses or None)  # what the store holds, oldest first
        self._next_id = 0
        self.store = Path(store) if store else None
        if self.store is not None and responses:
            self._open_store(tokenizer_id)

    @property
    def held(self) -> int:
        """Earlier responses the cross-request tree holds now."""
        return max(0, len(self._trees.cached_requests) - len(self._trees.active_requests)) if self.responses else 0

    def start(self, prompt_ids: Sequence[int]) -> int:
        """Begin a request; its id."""
        request, self._next_id = self._next_id, self._next_id + 1
        self._trees.start_request(request, np.asarray(prompt_ids, dtype=np.int32))
        return request

    def extend(self, request: int, token_ids: Sequence[int]) -> None:
        """Append newly committed tokens to the request's response."""
        self._trees.add_active_response(request, np.asarray(token_ids, dtype=np.int32))

    def speculate(self, request: int, context: Sequence[int], k: int, options: SuffixOptions):
        """The better of the two trees' continuations of `context` (at most k tokens)."""
        tail = np.asarray(context[-self.depth:], dtype=np.int32)
        return self._trees.speculate(request, tail, k, options.factor, options.offset, options.min_prob,
                                     options.tree)

    def stop(self, request: int, response: Sequence[int] | None) -> None:
        """End a request; its response stays in the cross-request tree (None: abandoned, dropped from it)."""
        self._trees.stop_request(request)
        if response is None and request in self._trees.cached_requests:
            self._trees.evict_cached_response(request)
        if response is not None and self.responses:
            self._held.append(list(response))
            if self.store is not None:
                self._append(list(response))

    def held_responses(self) -> list[list[int]]:
        """The responses held, oldest first."""
        return [list(r) for r in self._held]

    def save(self, directory: str | os.PathLike, tokenizer_id: str = "") -> Path:
        """Write the held responses (what this cache learned, as far as it was stored) to a directory: one that
        is new, empty, or a suffix cache already (never over another directory's files), atomically, under the
        directory's lock (another process appending waits)."""
        path = Path(directory)
        _check_store_dir(path)
        path.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            write_atomic(path / RESPONSES_FILE, "".join(json.dumps(r) + "\n" for r in self._held))
            write_atomic(path / META_FILE, json.dumps({"format": STORE_FORMAT, "tokenizer": tokenizer_id}) + "\n")
        return path

    def _open_store(self, tokenizer_id: str) -> None:
        """Load the store's responses (the newest `responses` of them), or create it."""
        meta = self.store / META_FILE
        _check_store_dir(self.store)
        if meta.exists():
            _check_meta(self.store, tokenizer_id)
            for response in read_responses(self.store / RESPONSES_FILE, self.responses):
                self.remember(response)
            if (self.store / RESPONSES_FILE).exists() and _count_lines(self.store / RESPONSES_FILE) > 2 * self.responses:
                self.save(self.store, tokenizer_id)  # compact: the store stays bounded too
        else:
            self.save(self.store, tokenizer_id)

    def remember(self, response: list[int]) -> None:
        """Put an earlier response in the cross-request tree (and the held list) without a prompt."""
        request = self.start([])
        self.extend(request, response)
        self._trees.stop_request(request)
        self._held.append(response)

    def _append(self, response: list[int]) -> None:
        """One line per response, under the directory's lock, flushed to disk; a line a kill left unfinished is
        closed first, so that it stays one damaged line (dropped on reading) and does not swallow this one."""
        with _locked(self.store), open(self.store / RESPONSES_FILE, "ab+") as f:
            f.seek(0, os.SEEK_END)
            if f.tell():
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
                f.seek(0, os.SEEK_END)
                if torn:
                    f.write(b"\n")
            f.write((json.dumps(response) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())


def tokenizer_fingerprint(tokenizer) -> str:
    """What token ids mean: a hash of the vocabulary (a store is only valid for the same tokenizer)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def _check_store_dir(path: Path) -> None:
    """Refuse a path that is a file, or a directory holding files but no suffix cache record: its files are not
    ours to overwrite."""
    if path.exists() and not path.is_dir():
        raise DraftlabError(f"cache={path} is a file; give a directory for the suffix cache")
    if path.is_dir() and not (path / META_FILE).exists() and any(
            p.name not in (LOCK_FILE,) for p in path.iterdir()):
        raise DraftlabError(f"cache={path} holds files but no {META_FILE}: not a suffix cache, left untouched; give "
                            "a new or empty directory")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """The directory's lock: one writer at a time (appends and rewrites), across processes."""
    with open(path / LOCK_FILE, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _check_meta(path: Path, tokenizer_id: str) -> None:
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise DraftlabError(f"{path / META_FILE} is not a suffix cache record: {exc}") from None
    if meta.get("format") != STORE_FORMAT:
        raise DraftlabError(f"{path} holds {meta.get('format')!r}, not a {STORE_FORMAT} suffix cache")
    if tokenizer_id and meta.get("tokenizer") and meta["tokenizer"] != tokenizer_id:
        raise DraftlabError(f"the suffix cache in {path} was written with another tokenizer "
                            f"({meta['tokenizer']}, this target's is {tokenizer_id}); use another directory")


def read_responses(path: Path, keep: int | None = None) -> list[list[int]]:
    """The newest `keep` (None: all) responses of a responses file (a line cut short by a kill is skipped)."""
    if not path.exists():
        return []
    responses: deque[list[int]] = deque(maxlen=keep or None)
    damaged = 0
    for line in path.read_bytes().splitlines():
        try:
            tokens = json.loads(line.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError too: a torn or foreign line
            damaged += 1
            continue
        if isinstance(tokens, list) and all(type(t) is int and 0 <= t < MAX_TOKEN_ID for t in tokens):
            responses.append(tokens)
        else:
            damaged += 1
    if damaged:
        print(f"suffix cache: {damaged} damaged line(s) of {path} dropped (a write cut short, or not token ids)",
              file=sys.stderr)
    return list(responses)


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


class SuffixDrafter(BlindDrafter):
    """Suffix decoding over a `SuffixCache` (its own, or one shared with other drafters of the same options)."""

    def __init__(self, options: SuffixOptions = SuffixOptions(), cache: SuffixCache | None = None,
                 tokenizer_id: str = "") -> None:
        self.options = options
        self.tokenizer_id = tokenizer_id
        self.cache = cache if cache is not None else SuffixCache(options.depth, options.responses, options.cache,
                                                                 tokenizer_id)
        self.name = "suffix" + ("/tree" if options.tree else "")
        self._request: int | None = None
        self._seen = 0  # committed tokens the request's tree holds
        self._prompt_len = 0

    def held(self) -> int:
        """Earlier responses the cache holds now."""
        return self.cache.held

    def forgetful(self) -> "SuffixDrafter":
        """The same options over a throwaway empty cache: warm-up runs teach the cache nothing (and copying a
        deployment's cache for them would cost more than the runs)."""
        return self.fork()

    def fork(self) -> "SuffixDrafter":
        """The same options over an empty cache kept in memory only (a sweep cell's own, a race round's)."""
        return SuffixDrafter(self.options, SuffixCache(self.options.depth, self.options.responses),
                             self.tokenizer_id)

    def beside(self, seq: int) -> "SuffixDrafter":
        """A drafter of another request in flight over the same cache: every request learns from the others'
        answers (the cache's trees hold one active request per drafter). Chains only: a server scores no trees."""
        if self.options.tree:
            raise DraftlabError("draftlab serve scores chains: use suffix (not suffix:tree)")
        return SuffixDrafter(self.options, self.cache, self.tokenizer_id)

    def state(self) -> dict:
        """The responses the cache holds, oldest first."""
        return {"responses": self.cache.held_responses()}

    def load_state(self, state: dict) -> None:
        """Hold `state`'s responses (the newest the cache's bound allows) after those held now."""
        responses = state["responses"]
        for response in responses[-self.options.responses:] if self.options.responses else []:
            self.cache.remember([int(t) for t in response])

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Start a request on the cache (ending one an error left open, without storing its response)."""
        if self._request is not None:
            self.cache.stop(self._request, None)
        self._request = self.cache.start(prompt_ids)
        self._seen = self._prompt_len = len(prompt_ids)

    def propose(self, context, k, sampling, generator) -> Proposal:
        """The suffix trees' continuation of the committed context: a chain, or a tree in topological order."""
        self._catch_up(context)
        draft = self.cache.speculate(self._request, context, k, self.options)
        if not draft.token_ids:
            return Proposal([])
        parents = tuple(draft.parents)
        tokens = list(draft.token_ids)
        if parents == chain_parents(len(tokens)):
            return Proposal(tokens)
        return Proposal(tokens, tuple(ROOT if p < 0 else p for p in parents))

    def finish(self, context: Sequence[int]) -> None:
        """The generation ended: store its response in the cross-request tree."""
        if self._request is None:
            return
        self._catch_up(context)
        self.cache.stop(self._request, list(context[self._prompt_len:]))
        self._request = None

    def _catch_up(self, context: Sequence[int]) -> None:
        """Give the request's tree the tokens committed since it last looked."""
        if len(context) > self._seen:
            self.cache.extend(self._request, context[self._seen:])
            self._seen = len(context)


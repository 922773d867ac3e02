"""`draftlab serve` as an engine a study starts, races and stops, as it races llama-server and vLLM.

A `ServeConfig` (the target's GGUF, drafter, K per requests in flight, slots) starts `draftlab serve` in a child
process on a free port of 127.0.0.1 only (`ServedProcess`: it answers `/health` before a request goes out, and stops
on every exit path, the death of the study included). Requests send token ids to `/v1/completions` with
`return_token_ids`; each answer carries its own drafted and accepted counts (`draftlab` in the body), exact under
load too. The server's scheduler scores each request's rows bitwise as that request alone, so its speculation is
lossless: ranked with the lossless, its outputs counted against draftlab's plain decoding. Its methods: its plain
decoding (`serve-ar`) and its speculation with each drafter it runs (`serve`: ngram and suffix decoding).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

from draftlab.backends.engines import LLAMACPP
from draftlab.contenders.contract import ContenderSource, Method, served_contender
from draftlab.contenders.served import PrefillShare, ServedProcess, ServedRun
from draftlab.decoding.metrics import GenerationStats
from draftlab.drafters.kinds import is_plain_drafter, learns_across_requests, serves_batched
from draftlab.engine import GenerationResult, check_room
from draftlab.errors import DraftlabError
from draftlab.measure import Contender, RunSettings
from draftlab.models import gguf_path

START_TIMEOUT_S = 180.0  # loading a GGUF and its repacked twin takes seconds
STOP_GRACE_S = 30.0
SERVED_NAME = "draftlab-target"
SERVE_DEPLOY = "on draftlab serve"  # what a Deploy line for draftlab serve says, after the model's name


@dataclass(frozen=True)
class ServeConfig:
    """One `draftlab serve` configuration."""

    target: str  # the GGUF's short name (NAME@TYPE) or path
    drafter: str = "none"
    k_per_load: str = "1:0"  # `--k-per-load` rows (plain decoding: K 0 at every load), or auto (`--k auto`)
    slots: int = 1  # --max-in-flight
    context: int = 4096  # --context: KV cells per slot
    queue: int = 64  # --max-queue: requests waiting beyond the slots before a 429
    name: str = SERVED_NAME  # --served-model-name ('': the target as given, what a deployed server answers to)
    backend: str = LLAMACPP.backend  # --backend: llama.cpp's, or a torch backend (`target` then may be an HF dir)
    device: str = "cpu"  # --device, on a torch backend
    api_key: str = ""  # --api-key ('': none)
    suffix_cache: str = ""  # --suffix-cache: suffix decoding's cache kept in this directory across restarts
    prompt_cache: bool = True  # False: --no-prompt-cache (every prompt prefilled whole)

    def flags(self) -> list[str]:
        """`draftlab serve`'s arguments (the host and port come from `launch`)."""
        k = ["--k", "auto"] if self.k_per_load == "auto" else ["--k-per-load", self.k_per_load]
        flags = ["--target", self.target, "--drafter", self.drafter, *k,
                 "--max-in-flight", str(self.slots), "--max-queue", str(self.queue), "--context", str(self.context)]
        if self.backend != LLAMACPP.backend:
            flags += ["--backend", self.backend, "--device", self.device]
        flags += ["--api-key", self.api_key] if self.api_key else []
        flags += ["--suffix-cache", self.suffix_cache] if self.suffix_cache else []
        flags += [] if self.prompt_cache else ["--no-prompt-cache"]
        return flags + (["--served-model-name", self.name] if self.name else [])

    def command(self) -> str:
        """The command a user deploys this configuration with (as the study ran it)."""
        return shlex.join(["draftlab", "serve", *self.flags(), "--host", "127.0.0.1", "--port", "8000"])

    def prefill_group(self) -> str:
        """'': each server prefills for itself."""
        return ""

    def server(self, log_dir: Path) -> "DraftlabServer":
        return DraftlabServer(self, log_dir)


@dataclass
class DraftlabServer(ServedProcess):
    """One running `draftlab serve` (a context manager; its log draftlab-serve-PORT.log in `log_dir`)."""

    NAME: ClassVar[str] = "draftlab-serve"
    START_TIMEOUT_S: ClassVar[float] = START_TIMEOUT_S
    config: ServeConfig

    def start(self) -> None:
        """Start it from this Python's environment on a free loopback port and wait until it answers."""
        self.launch([sys.executable, "-m", "draftlab.cli", "serve", *self.config.flags()], {})

    def _start_failure(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines() if self.log.exists() else []
        return (f"draftlab serve exited at start (code {self.process.returncode}): "
                f"{(lines or ['no output'])[-1][:200]}; log: {self.log}")

    def stop(self) -> None:
        """SIGTERM (it drains what is in flight), SIGKILL after a grace; reaped."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def completion(self, prompt_ids: list[int], settings: RunSettings, max_tokens: int | None = None,
                   max_draft: int | None = None) -> dict:
        """One `/v1/completions` request of token ids (`max_draft`: its `speculative.n_max`); the JSON answer."""
        body = {"model": SERVED_NAME, "prompt": list(prompt_ids), "temperature": settings.temperature,
                "top_p": settings.top_p, "top_k": settings.top_k, "seed": settings.seed,
                "max_tokens": max_tokens or settings.max_new_tokens, "return_token_ids": True}
        if max_draft is not None:
            body["speculative.n_max"] = max_draft
        return self.post("/v1/completions", body, self.config.api_key)

    def prefill(self, prompt_ids: list[int]) -> None:
        """Nothing kept: the server prefills each request (its prompt cache off, `_server`)."""

    def contender(self, context_length: int, reuse: bool = True, share: PrefillShare | None = None
                  ) -> "DraftlabServeRun":
        return DraftlabServeRun(self, context_length, False, None)


@dataclass(frozen=True)
class DraftlabServeRun(ServedRun):
    """A running `draftlab serve` as a contender: whole requests, each prefilling its prompt; the prefill is the
    seconds the server says its prefill took (`draftlab.prefill_s` of the answer)."""

    times_prefill = True
    max_draft: int | None = None  # each request's `speculative.n_max` (None: the server's K)

    def run(self, prompt_ids: list[int], settings) -> GenerationResult:
        check_room(len(prompt_ids), settings.max_new_tokens, self.context_length)
        answer = self.server.completion(prompt_ids, settings, max_draft=self.max_draft)
        choice, extra = answer["choices"][0], answer.get("draftlab", {})
        tokens = [int(t) for t in choice.get("token_ids") or []]
        stats = GenerationStats(prompt_tokens=len(prompt_ids), new_tokens=len(tokens),
                                drafted=int(extra.get("drafted", 0)), accepted=int(extra.get("accepted", 0)),
                                steps=int(extra.get("steps", 0)), prefill_s=float(extra.get("prefill_s", 0.0)),
                                stop_reason=str(choice.get("finish_reason", "")))
        return GenerationResult(tokens, "", stats)


def serves(drafter: str) -> bool:
    """Whether `draftlab serve` races the drafter: a speculative one whose drafts serve several sequences at once."""
    return serves_batched(drafter) and not is_plain_drafter(drafter)


def server_slots(drafter: str, concurrency: int, most_in_flight: int) -> int:
    """Slots of a cell's server: one server per configuration serves every level; suffix decoding, whose cache keeps
    every answer it served, one server per level (as vLLM's, `contenders.vllm.server_slots`)."""
    return concurrency if learns_across_requests(drafter) else max(most_in_flight, concurrency)


def server_k(drafter: str, k: int, most_k: int) -> int:
    """The K a cell's server drafts at: a drafter that learns nothing across requests, at a fixed K, shares one
    server at the grid's longest K (`most_k`) with the drafter's other K, each request capped at its cell's K
    (`speculative.n_max`), so that a grid of K values starts one server, not one per K; else the cell's K."""
    shared = serves(drafter) and not learns_across_requests(drafter) and 0 < k <= most_k
    return most_k if shared else k


def _server(source: ContenderSource, cell, companions: tuple) -> Contender:
    servers = source.servers
    slots = server_slots(cell.drafter, cell.concurrency, servers.most_in_flight if servers else 1)
    k = server_k(cell.drafter, cell.k, servers.most_k if servers else 0)
    k_per_load = "auto" if cell.k == 0 and serves(cell.drafter) else f"1:{k}"  # K 0 with a drafter: `--k auto`
    # no prompt cache: each prompt prefills whole, as llama-server's cells run (cache_prompt off), whatever the prompts
    # share (a chat template's system turn); the Deploy line's server keeps it on
    config = ServeConfig(str(gguf_path(source.target.source)), cell.drafter, k_per_load, slots, prompt_cache=False)
    capped = (lambda run: replace(run, max_draft=cell.k)) if k != cell.k else None
    return served_contender(source, cell, companions, config, capped)


SERVE_AR = Method("serve-ar", "draftlab serve", 2, "draftlab serve", plain=True, reference="ar", peer=True,
                  gguf_only=True, served=True, swept=False, chosen=False, build=_server)
# exact: each request's rows are scored bitwise as alone, so its greedy outputs are draftlab's plain decoding's
SERVE = Method("serve", "draftlab serve's speculation", 4, "draftlab serve", plain=False, reference="serve-ar",
               peer=True, gguf_only=True, served=True, build=_server, takes=serves)
METHODS = (SERVE_AR, SERVE)  # a cell per drafter it runs x K x concurrency level

"""vLLM as an engine the study starts, races and stops: `vllm serve` from its own environment (`vllm_env`).

A `VllmServer` runs one configuration (`VllmConfig`: the target's Hugging Face directory, its dtype, vLLM's
`--speculative-config`, the most requests at once) on a free port of 127.0.0.1 only, waits until it answers
`/health`, and is stopped on every exit path: `stop()` signals its whole process group (vLLM runs an engine core
and workers beside its API server), leaving a `with` block, and the death of the Python process that started it
(the kernel signals the server: `PR_SET_PDEATHSIG`). Its output goes to a log file every error names.

Requests send token ids to `/v1/completions` with `return_token_ids`; the drafted and accepted tokens are the
differences of vLLM's own counters (`/metrics`) around a request, exact with one request in flight. vLLM caches
prompt prefixes: the measurement loop's prefill (the prompt for one token, timed as a whole request) leaves the
prompt cached, so each timed run is mostly vLLM's decode. Its methods (`contenders.contract`) are its plain
decoding and its own speculation with each drafter of the grid that has a vLLM counterpart (`deploy.vllm_config`:
ngram, suffix, a draft model, EAGLE-3): the study runs the speculative config `--export vllm` prints. vLLM's
verification rounds a block's rows apart from single rows (in bf16 on an AVX-512 host, one of two prompts left
its plain decoding after 76 tokens): its speculation equals its plain decoding only up to rounding, counted and
never ranked with the lossless.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from draftlab.contenders import vllm_env
from draftlab.contenders.contract import ContenderSource, Method, served_contender
from draftlab.contenders.served import PrefillShare, ServedProcess, ServedRun, processes
from draftlab.decoding.metrics import GenerationStats
from draftlab.deploy import Deployable, vllm_config
from draftlab.drafters.eagle3_checkpoint import engines_checkpoint, ensure_engines_checkpoint
from draftlab.drafters.kinds import learns_across_requests
from draftlab.drafters.shipped import shipped_draft
from draftlab.engine import GenerationResult, check_room
from draftlab.errors import DraftlabError
from draftlab.measure import Contender, RunSettings
from draftlab.models import LoadedModel, resolve_directory

START_TIMEOUT_S = 900.0  # a first start compiles the model (~100 s for a 135M model on 2 cores)
STOP_GRACE_S = 20.0
CONTEXT = 4096  # --max-model-len: the longest shipped prompt plus its answer fits
KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: the KV cache of every slot together (~46k tokens of SmolLM2 in bf16)
SERVED_NAME = "draftlab-target"  # --served-model-name: what requests name
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DRAFTED = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


@dataclass(frozen=True)
class VllmConfig:
    """One vLLM configuration: what a start of `vllm serve` is given."""

    model: Path  # a Hugging Face directory (draftlab's converted checkpoint for a GGUF source)
    dtype: str  # draftlab's name of it: fp32, bf16 or fp16
    speculative: str = ""  # --speculative-config, as JSON; '' for plain decoding
    slots: int = 1  # --max-num-seqs: requests served at once
    context: int = CONTEXT

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise DraftlabError(f"vLLM runs {', '.join(DTYPES)} here, not {self.dtype}")
        if self.slots < 1 or self.context < 1:
            raise DraftlabError("vLLM needs slots >= 1 and a context >= 1")

    def flags(self) -> list[str]:
        """`vllm serve`'s arguments for this configuration (the host and port come from `VllmServer`)."""
        args = [str(self.model), "--dtype", DTYPES[self.dtype], "--max-model-len", str(self.context),
                "--max-num-seqs", str(self.slots), "--served-model-name", SERVED_NAME]
        return args + (["--speculative-config", self.speculative] if self.speculative else [])

    def env(self) -> dict[str, str]:
        """What the server's environment needs: the CPU platform and its KV cache."""
        return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}

    def command(self) -> str:
        """The command line a user deploys this configuration with (as the study ran it)."""
        env = [f"{key}={value}" for key, value in self.env().items()]
        return " ".join([*env, shlex.join(["vllm", "serve", *self.flags(), "--host", "127.0.0.1", "--port", "8000"])])

    def prefill_group(self) -> str:
        """'': each vLLM server prefills for itself (vLLM copies no prompt cache between servers)."""
        return ""

    def server(self, log_dir: Path) -> "VllmServer":
        """A server of this configuration (not started)."""
        return VllmServer(self, log_dir)


@dataclass
class VllmServer(ServedProcess):
    """One running `vllm serve` (a context manager: started on entry, stopped on exit; its log vllm-PORT.log in
    `log_dir`)."""

    NAME: ClassVar[str] = "vllm"
    START_TIMEOUT_S: ClassVar[float] = START_TIMEOUT_S
    config: VllmConfig

    def start(self) -> None:
        """Start the server on a free loopback port, in a process group of its own, and wait until it answers
        (`ServedProcess.launch`); vLLM's environment is made first where it is missing."""
        vllm_env.ensure()
        self.launch([str(vllm_env.vllm_command()), "serve", *self.config.flags()], self.config.env(), own_group=True)

    def _start_failure(self) -> str:
        return f"vllm serve exited at start (code {self.process.returncode}): {self._last_error()}; log: {self.log}"

    def _last_error(self) -> str:
        """The last line of its log that names an error (Python's exceptions end a traceback with one)."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "no log"
        errors = [line for line in lines if "Error" in line or "error" in line]
        return (errors or lines or ["no output"])[-1].strip()[:200]

    def stop(self) -> None:
        """Stop the server and its engine processes (SIGTERM to its group, SIGKILL after a grace) and reap it."""
        if self.process is None or self.process.poll() is not None:
            return
        group = os.getpgid(self.process.pid)
        os.killpg(group, signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(group, signal.SIGKILL)  # what is left of the group: the engine core, its workers
        except ProcessLookupError:
            pass
        self.process.wait()
        _wait_gone(group)

    def completion(self, prompt_ids: list[int], settings: RunSettings, max_tokens: int | None = None) -> dict:
        """One `/v1/completions` request: the prompt as token ids, the loop's settings; vLLM's JSON answer."""
        body = {"model": SERVED_NAME, "prompt": list(prompt_ids), "temperature": settings.temperature,
                "max_tokens": max_tokens or settings.max_new_tokens, "top_p": settings.top_p, "seed": settings.seed,
                "return_token_ids": True, "stream": False}
        if settings.top_k > 0:
            body["top_k"] = settings.top_k
        return self.post("/v1/completions", body)

    def counters(self) -> tuple[int, int]:
        """vLLM's drafted and accepted token counters (0, 0 without speculation)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as response:
            text = response.read().decode()
        values = {line.split("{")[0].split()[0]: float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith("vllm:spec_decode_num")}
        return int(values.get(DRAFTED, 0)), int(values.get(ACCEPTED, 0))

    def prefill(self, prompt_ids: list[int]) -> None:
        """The prompt's prefill: one request of one token (vLLM keeps the prompt in its prefix cache)."""
        self.completion(prompt_ids, RunSettings(max_new_tokens=1, temperature=0.0))

    def contender(self, context_length: int, reuse: bool = True, share: PrefillShare | None = None) -> "VllmRun":
        """This server as a contender of the measurement loop; `reuse`: the loop prefills each prompt first (vLLM
        keeps it in its prefix cache); `share`: always None (`VllmConfig.prefill_group`)."""
        return VllmRun(self, context_length, reuse, share)


def _wait_gone(group: int, timeout_s: float = STOP_GRACE_S) -> None:
    """Until no live process of the group is left (a killed process takes a moment to exit; a zombie is dead)."""
    deadline = time.monotonic() + timeout_s
    while _group_alive(group) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group_alive(group: int) -> bool:
    """Whether a process of the group runs (a zombie is dead)."""
    return any(pgrp == group and state != "Z" for _, state, _, pgrp in processes())


@dataclass(frozen=True)
class VllmRun(ServedRun):
    """A running vLLM as a contender of the measurement loop: it times only whole requests; after `prefill` (the
    prompt for one token), a run starts from the prompt vLLM cached."""

    times_prefill = False

    def run(self, prompt_ids: list[int], settings) -> GenerationResult:
        """One request; a prompt that does not fit the context is refused as draftlab's engine refuses it."""
        check_room(len(prompt_ids), settings.max_new_tokens, self.context_length)
        drafted, accepted = self.server.counters()
        answer = self.server.completion(prompt_ids, settings)
        after = self.server.counters()
        choice = answer["choices"][0]
        tokens = [int(t) for t in choice.get("token_ids") or []]
        drafted, accepted = after[0] - drafted, after[1] - accepted
        stats = GenerationStats(prompt_tokens=len(prompt_ids), new_tokens=len(tokens), drafted=drafted,
                                accepted=accepted, steps=max(len(tokens) - accepted, 0),
                                stop_reason=str(choice.get("finish_reason", "")))
        return GenerationResult(tokens, "", stats)


def speculative_config(target: str, drafter: str, k: int, loaded: LoadedModel | None = None) -> str:
    """vLLM's --speculative-config of a drafter at K, as `--export vllm` writes it, a draft model by its local
    directory and an EAGLE-3 draft by its engines' checkpoint, written once where `loaded` (the target) is given
    ('' for plain decoding); a one-line error where vLLM has no counterpart."""
    def eagle3_path(draft: str, name: str) -> str:
        directory = Path(draft).expanduser() if draft else shipped_draft(name, "eagle3")
        return str(ensure_engines_checkpoint(directory, loaded) if loaded else engines_checkpoint(directory))

    config = vllm_config(Deployable(target, drafter, k), model_path=lambda name: str(resolve_directory(name)),
                         eagle3_path=eagle3_path)
    return "" if config is None else json.dumps(config, separators=(",", ":"))


def deploy_command(target: str, dtype: str, drafter: str, k: int, most_in_flight: int = 1) -> str:
    """The `vllm serve` command of a cell alone (one request at a time), as the study ran it (`most_in_flight`: the
    study's highest concurrency level)."""
    slots = server_slots(drafter, 1, most_in_flight)
    return VllmConfig(resolve_directory(target), dtype, speculative_config(target, drafter, k), slots).command()


def server_slots(drafter: str, concurrency: int, most_in_flight: int) -> int:
    """The --max-num-seqs of a cell's server: one server per configuration serves every level of the study
    (`most_in_flight`: the highest); suffix decoding, whose cache keeps every answer it served, gets one server per
    level, so that no level decodes a prompt whose answer another level taught it."""
    return concurrency if learns_across_requests(drafter) else max(most_in_flight, concurrency)


def runs_in_vllm(drafter: str) -> bool:
    """Whether vLLM has a counterpart of the drafter (a cell of its own speculation)."""
    try:
        vllm_config(Deployable("target", drafter, 1))
    except DraftlabError:
        return False
    return True


def missing() -> str:
    """Why vLLM cannot run here ('' when it can): its environment is made first where it is missing."""
    try:
        vllm_env.ensure()
    except DraftlabError as exc:
        return str(exc)
    return ""


def _server(source: ContenderSource, cell, companions: tuple) -> Contender:
    """The cell's server (`server_slots`: which levels it serves; vLLM batches whatever is in flight)."""
    slots = server_slots(cell.drafter, cell.concurrency, source.servers.most_in_flight if source.servers else 1)
    config = VllmConfig(resolve_directory(source.target.source), cell.dtype,
                        speculative_config(cell.target, cell.drafter, cell.k, source.target), slots=slots)
    return served_contender(source, cell, companions, config)


VLLM_AR = Method("vllm-ar", "vLLM", 2, "vLLM", plain=True, reference="ar", times_prefill=False, peer=True,
                 torch_only=True, served=True, swept=False, chosen=False, build=_server, missing=missing)
# vLLM's verification rounds a block's rows apart from single rows: equal to its plain decoding up to rounding only
VLLM = Method("vllm", "vLLM's own speculation", 4, "vLLM", plain=False, reference="vllm-ar", lossless=False,
              times_prefill=False, peer=True, torch_only=True, served=True, build=_server, takes=runs_in_vllm,
              missing=missing)
METHODS = (VLLM_AR, VLLM)  # a cell per drafter with a counterpart x K x concurrency level

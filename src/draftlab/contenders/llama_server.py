"""llama-server, llama.cpp's OpenAI-compatible server, as an engine draftlab starts, drives and stops.

What CPU users deploy, with its own speculative decoding (`--spec-type`). `scripts/build-llama-cpp.sh` builds it
from the llama.cpp that llama-cpp-python vendors, in the same build as draftlab's llamacpp backend's libraries, into
draftlab's cache; `$DRAFTLAB_LLAMA_SERVER` names another binary. A `LlamaServer` runs one configuration (`ServerConfig`: the
model, a draft, the speculative flags, threads, slots) on a free port of 127.0.0.1 only, waits until it answers
`/health`, and is stopped on every exit path: `stop()`, leaving a `with` block (an exception, Ctrl-C), and the
death of the Python process that started it (the kernel signals the server: `PR_SET_PDEATHSIG`), so no server is
left behind. Its output goes to a log file every error names.

Requests send token ids to `/completion` with `return_tokens: true`, and `cache_prompt: true` after the measurement
loop's prefill of the prompt (one request of one token: the prompt's prefill, timed apart), so that each timed run
is the server's decode; under load, `cache_prompt: false` (each request prefills); the response gives the output ids and the server's own counters (`timings`: prompt and
decode milliseconds, drafted and accepted tokens). `LlamaServerRun` is a contender of the measurement loop
(`draftlab.measure`). Per-request speculative settings are compiled out of this llama.cpp version, so each
speculative configuration is its own server start; servers that differ only in their speculation share a prompt's
prefill: one computes it, and the others load its slot (`/slots/0?action=save|restore`, a file of the prompt's
tokens, keys and values: bitwise what their own prefill would hold, one build, file and context).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import ClassVar

from draftlab.backends.gguf import EXACT_ENV, EXACT_KERNELS, REPACK_EXACT, repack_keeps_rows, tensor_types
from draftlab.files import assets
from draftlab.engine import GenerationResult, check_room
from draftlab.errors import DraftlabError
from draftlab.contenders.served import PrefillShare, ServedProcess, ServedRun
from draftlab.decoding.metrics import GenerationStats
from draftlab.deploy import SPEC_TYPES
from draftlab.measure import RunSettings

SERVER_VERSION = "0.3.36"  # the llama-cpp-python release whose vendored llama.cpp it is built from
BUILD_HINT = "build it with scripts/build-llama-cpp.sh (~7 minutes on 2 cores), or set DRAFTLAB_LLAMA_SERVER"
START_TIMEOUT_S = 180.0  # loading a 1.5B model on 2 cores takes seconds; a stuck start is an error


def server_binary() -> Path:
    """The llama-server binary: `$DRAFTLAB_LLAMA_SERVER`, else the one the build script put in draftlab's cache."""
    explicit = os.environ.get("DRAFTLAB_LLAMA_SERVER")
    path = Path(explicit).expanduser() if explicit else build_dir() / "server" / "llama-server"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise DraftlabError(f"llama-server not found at {path}; {BUILD_HINT}")
    return path


def exact_server() -> bool:
    """Whether the llama-server here holds every one of draftlab's exact kernels (`EXACT_KERNELS`): then, started
    as `ServerConfig` starts it (flash attention off, repack off where it rounds rows apart, the tiled K-quant
    matmul off), its block rows round as its single rows and its own speculation is greedy-identical to its plain
    decoding, as draftlab's llama.cpp engine is. False for a missing binary or another build."""
    return set(EXACT_KERNELS) <= set(server_kernels())


def server_kernels() -> tuple[str, ...]:
    """draftlab's exact kernels in the llama-server here (its binary, or its ggml-cpu); () for none or another build."""
    try:
        path = server_binary()
    except DraftlabError:
        return ()
    files = [path, *(f.resolve() for f in sorted(path.parent.glob("libggml-cpu.so*")))]  # static, or its ggml-cpu
    return tuple(dict.fromkeys(name for f in dict.fromkeys(files) if f.is_file()
                               for name in _kernels_in(f, f.stat().st_mtime_ns, f.stat().st_size)))


@lru_cache(maxsize=8)
def _kernels_in(path: Path, mtime_ns: int, size: int) -> tuple[str, ...]:
    """The exact kernels whose marker symbols (`ggml_cpu_draftlab_<name>`) a binary or library holds (read once per
    file version)."""
    data = path.read_bytes()
    return tuple(name for name in EXACT_KERNELS if b"ggml_cpu_draftlab_" + name.replace("-", "_").encode() in data)


def build_dir() -> Path:
    """Where scripts/build-llama-cpp.sh puts its build: lib/, server/ and the GGUF converter in convert/."""
    return assets.cache_dir() / "llama.cpp" / SERVER_VERSION


def server_built() -> bool:
    """Whether `server_binary` finds a binary."""
    try:
        server_binary()
    except DraftlabError:
        return False
    return True


@dataclass(frozen=True)
class ServerConfig:
    """One llama-server configuration: what a start of the server is given."""

    model: Path  # a GGUF file
    spec_type: str = ""  # '' for plain decoding; one of SPEC_TYPES, or a comma list of them
    draft: Path | None = None  # a draft GGUF (`-md`), for the draft-* types
    draft_n_max: int | None = None  # --spec-draft-n-max: the most tokens drafted a step (K)
    draft_n_min: int | None = None
    draft_p_min: float | None = None  # --spec-draft-p-min, for draft models
    threads: int = 0  # 0: the cores this process may run on
    slots: int = 1  # -np: requests served at once
    context: int = 4096  # -c: the context of all slots together
    extra: tuple[str, ...] = ()  # other flags, passed on as they are (after draftlab's, so they win)

    def __post_init__(self) -> None:
        unknown = [t for t in self.spec_type.split(",") if t and t not in SPEC_TYPES]
        if unknown:
            raise DraftlabError(f"unknown llama-server --spec-type {unknown[0]!r}; use one of {', '.join(SPEC_TYPES)}")
        if self.spec_type.startswith("draft-") and self.draft is None:
            raise DraftlabError(f"--spec-type {self.spec_type} drafts with a draft model: give its GGUF")
        if self.slots < 1 or self.context < 1 or self.threads < 0:
            raise DraftlabError("llama-server needs slots >= 1, a context >= 1 and threads >= 0")

    def flags(self) -> list[str]:
        """The server's arguments for this configuration (the host and port come from `LlamaServer`)."""
        threads = str(self.threads or len(os.sched_getaffinity(0)))
        args = ["-m", str(self.model), "-t", threads, "-tb", threads, "-np", str(self.slots), "-c", str(self.context),
                "-fa", "off", "--no-webui"]
        if not self._repack_exact() and "--no-repack" not in self.extra:
            args += ["--no-repack"]  # these types' repacked kernels round a block's rows unlike the rows alone
        if self.draft is not None:
            args += ["-md", str(self.draft)]
        if self.spec_type:
            args += ["--spec-type", self.spec_type]
        for flag, value in (("--spec-draft-n-max", self.draft_n_max), ("--spec-draft-n-min", self.draft_n_min),
                            ("--spec-draft-p-min", self.draft_p_min)):
            if value is not None:
                args += [flag, str(value)]
        return args + list(self.extra)

    def _repack_exact(self) -> bool:
        """Whether the model's repacked weights keep rows exact on the server's kernels (a file the server cannot
        read: let it say so)."""
        try:
            return repack_keeps_rows(self.model, server_kernels())
        except DraftlabError:
            return True

    def env(self) -> dict[str, str]:
        """What the server's environment needs beyond the user's: the tiled K-quant matmul off, as for draftlab's
        own llama.cpp engine (it serves 8+ rows of K-quants it does not repack, so rows would round unlike the rows
        alone), for every file with a type outside `REPACK_EXACT`."""
        try:
            untiled = tensor_types(self.model) <= REPACK_EXACT
        except DraftlabError:
            untiled = True
        return {} if untiled else dict(EXACT_ENV)

    def server(self, log_dir: Path) -> "LlamaServer":
        """A server of this configuration (not started)."""
        return LlamaServer(self, log_dir)

    def prefill_group(self) -> str:
        """What its prefill of a prompt is one computation with: the servers of the same build, file, threads and
        context that differ only in their speculation ('' where it is its own: a draft model holds a cache the
        slot file leaves out; several slots, which a copy would have to name)."""
        if self.draft is not None or self.slots != 1:
            return ""
        args, kept = self.flags(), []
        for i, arg in enumerate(args):
            if not (arg.startswith("--spec") or (i and args[i - 1].startswith("--spec"))):
                kept.append(arg)
        return " ".join([*(f"{key}={value}" for key, value in self.env().items()), *kept])

    def command(self) -> str:
        """The command line a user deploys this configuration with (draftlab's build of llama-server: its kernels
        keep a verification block's rows exact, so the server's own speculation is greedy-identical to its plain
        decoding)."""
        env = [f"{key}={value}" for key, value in self.env().items()]
        return " ".join([*env, "llama-server", *self.flags(), "--host", "127.0.0.1", "--port", "8080"])


def _message(line: str) -> str:
    """A log line without llama.cpp's time stamp and level."""
    return line.split(" E ", 1)[-1].strip()[:200]


@dataclass
class LlamaServer(ServedProcess):
    """One running llama-server (a context manager: started on entry, stopped on exit; its log llama-server-PORT.log
    in `log_dir`)."""

    NAME: ClassVar[str] = "llama-server"
    START_TIMEOUT_S: ClassVar[float] = START_TIMEOUT_S
    config: ServerConfig

    def start(self) -> None:
        """Start the server on a free loopback port and wait until it answers (`ServedProcess.launch`), with a
        directory for its slot files (`save_prompt`; a measurement aid, not part of its deployed command)."""
        self.slot_dir.mkdir(parents=True, exist_ok=True)
        self.launch([str(server_binary()), *self.config.flags(), "--slot-save-path", f"{self.slot_dir}/"], EXACT_ENV)

    @property
    def slot_dir(self) -> Path:
        """Where the servers of one study write and read slot files: one directory beside their logs."""
        return self.log_dir / "slots"

    def _start_failure(self) -> str:
        """Why the server exited at start, in one line, with the fix where its log says the cause."""
        errors = self._log_errors()
        if any("bind" in line.lower() for line in errors):
            return (f"llama-server could not listen on 127.0.0.1:{self.port}: the port is taken; stop what listens "
                    f"there, or leave the port to draftlab (it picks a free one); log: {self.log}")
        refused = [line for line in errors if "failed to load model" in line or "error loading model" in line]
        if refused:
            return (f"llama-server refused the model {self.config.model} ({_message(refused[0])}); give a GGUF file "
                    f"this llama.cpp reads; log: {self.log}")
        cause = _message(errors[0]) if errors else "no error in its log"
        return f"llama-server exited at start (code {self.process.returncode}): {cause}; log: {self.log}"

    def _log_errors(self) -> list[str]:
        """The error lines of the server's log (llama.cpp marks them ' E ')."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [line for line in lines if " E " in line]

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and reap it."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def completion(self, prompt_ids: list[int], settings, cache_prompt: bool = False) -> dict:
        """One `/completion` request: the prompt as token ids, the loop's settings; the server's JSON answer.
        `cache_prompt`: the server may start from the prefix of the prompt its slot holds (else it prefills)."""
        body = {"prompt": list(prompt_ids), "n_predict": settings.max_new_tokens, "temperature": settings.temperature,
                "top_k": settings.top_k, "top_p": settings.top_p, "min_p": 0.0, "repeat_penalty": 1.0,
                "seed": settings.seed, "cache_prompt": cache_prompt, "return_tokens": True, "stream": False}
        return self.post("/completion", body)

    def prefill(self, prompt_ids: list[int]) -> None:
        """The prompt's prefill: one request of one token, which its slot then holds (`cache_prompt`)."""
        self.completion(prompt_ids, RunSettings(max_new_tokens=1, temperature=0.0), cache_prompt=True)

    def save_prompt(self, name: str) -> None:
        """Its slot's cache (the prompt and its keys and values) written to `name` in `slot_dir`."""
        self.post("/slots/0?action=save", {"filename": name})

    def load_prompt(self, name: str) -> None:
        """Its slot made to hold what a server of the same build, file and context saved to `name`."""
        self.post("/slots/0?action=restore", {"filename": name})

    def contender(self, context_length: int, reuse: bool = True, share: PrefillShare | None = None
                  ) -> "LlamaServerRun":
        """This server as a contender of the measurement loop; `reuse`: its requests start from the prompt's
        prefill (`cache_prompt`; False under load, where each request prefills); `share`: the servers whose
        prefill is one computation with its own (`ServerConfig.prefill_group`)."""
        return LlamaServerRun(self, context_length, reuse, share)


@dataclass(frozen=True)
class LlamaServerRun(ServedRun):
    """A running llama-server as a contender of the measurement loop (`draftlab.measure.Contender`): the prefill
    is the server's own prompt time; drafted and accepted tokens are its counters. With `reuse`, `prefill` sends
    the prompt for one token and each run then asks for `cache_prompt`: the server starts from the prompt its slot
    holds (it evaluates the prompt's last token again), as it does for its users' repeated prefixes."""

    times_prefill = True

    def run(self, prompt_ids: list[int], settings) -> GenerationResult:
        """One request; a prompt that does not fit a slot's context is refused as draftlab's engine refuses it."""
        check_room(len(prompt_ids), settings.max_new_tokens, self.context_length)
        answer = self.server.completion(prompt_ids, settings, cache_prompt=self.reuse)
        tokens = [int(t) for t in answer.get("tokens", [])]
        timings = answer.get("timings", {})
        drafted, accepted = int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))
        stats = GenerationStats(prompt_tokens=len(prompt_ids), new_tokens=len(tokens), drafted=drafted,
                                accepted=accepted, steps=max(len(tokens) - accepted, 0),
                                prefill_s=float(timings.get("prompt_ms", 0.0)) / 1000,
                                stop_reason=str(answer.get("stop_type", "")))
        return GenerationResult(tokens, "", stats)

"""Engines checked before a study, `bench` or `tune` leans on them: each decodes a few tokens in a child process.

A native library that crashes (ggml's AMX kernels on some Intel CPUs die with a general protection fault, exit 139)
takes the whole Python process with it, with no message. So before the work starts, each engine the work will run
(draftlab's torch backend on its device, llama.cpp through llama-cpp-python in process, llama-server) loads the
target and decodes `TOKENS` tokens in a child, with the numerics the work will use (on llama.cpp both its exact
kernels and its default ones, which repack the weights). An engine whose child is killed by a signal, exits
nonzero or hangs past the time limit is left out with one line naming the engine, what happened and what to do;
the work goes on with the others.

`DRAFTLAB_PREFLIGHT_FAULT=ENGINE:MODE[:SOURCE]` (ENGINE: torch, llamacpp or llama-server; MODE: segv, hang,
hang=SECONDS or exit) makes the child of that engine (on that model) die that way before it decodes: how the tests
reproduce a crashing library on any host. `hang=SECONDS` is judged by its own limit: the parent waits that long for
that child, while every other engine keeps the work's limit, which a healthy engine on a slow host meets with a wide
margin (a tiny model's check takes ~10 s on the slowest hosts seen; the default limit is 300 s).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from draftlab.api import SpeculativeDecoder, prompt_ids
from draftlab.backends.engines import LLAMA_SERVER, LLAMACPP, TORCH, engine_named, engine_of_backend
from draftlab.contenders.llama_server import LlamaServer, server_built
from draftlab.contenders.plain import fastest_plain
from draftlab.contenders.server_configs import spec_config
from draftlab.errors import DraftlabError
from draftlab.files.datasets import Prompt
from draftlab.measure import RunSettings
from draftlab.models import gguf_path, load_model

TOKENS = 4  # decoded by each check: enough to run prefill, a block and single-token steps
TIMEOUT_S = 300  # a check that has not answered after this long hangs (loading a 1.5B model in fp32 takes ~30 s)
FAULT_ENV = "DRAFTLAB_PREFLIGHT_FAULT"
PREFLIGHTED = (TORCH.name, LLAMACPP.name, LLAMA_SERVER.name)  # the engines checked, by `backends.engines` name
REMEDY = {
    TORCH.name: "check torch on that device, or run with another --device or --dtype",
    LLAMACPP.name: "rebuild llama.cpp with ./run.sh --setup-only (it rebuilds a library that holds ggml's AMX "
                 "kernels; docs/backends.md)",
    LLAMA_SERVER.name: "rebuild it: remove draftlab's llama.cpp build (~/.cache/draftlab/llama.cpp) and run "
                    "scripts/build-llama-cpp.sh",
}


@dataclass(frozen=True)
class EngineCheck:
    """One engine to check: which engine, on which target and with which numerics (as the work will load it)."""

    engine: str  # one of PREFLIGHTED
    source: str  # the model: a short name, a directory or a .gguf file
    device: str = "cpu"
    dtype: str = "auto"
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.engine not in PREFLIGHTED:
            raise DraftlabError(f"unknown engine {self.engine!r}: use {', '.join(PREFLIGHTED)}")

    def words(self) -> str:
        """The engine in words, for its line."""
        if self.engine == TORCH.name:
            return f"draftlab's torch backend ({self.source} on {self.device}, {self.dtype})"
        return f"{engine_named(self.engine).label} ({self.source})"


@dataclass(frozen=True)
class Verdict:
    """What a check found: `line` is empty when the engine decoded, else the one line that leaves it out."""

    check: EngineCheck
    line: str = ""

    @property
    def ok(self) -> bool:
        return not self.line


def engine_checks(source: str, backend: str, device: str, dtype: str, servers: bool) -> list[EngineCheck]:
    """The engines a target runs on: draftlab's torch backend, or llama.cpp in process and, with `servers`,
    llama-server when it is built (without it, its cells are left out by the caller, with their own line)."""
    if not engine_of_backend(backend).runs_gguf:
        return [EngineCheck(TORCH.name, source, device, dtype, backend)]
    checks = [EngineCheck(LLAMACPP.name, source, "cpu", "auto", backend)]
    if servers and server_built():
        checks.append(EngineCheck(LLAMA_SERVER.name, source, "cpu", "auto", backend))
    return checks


def require(checks: list[EngineCheck], timeout_s: float, command: str) -> set[str]:
    """For a command that runs one target (`bench`, `tune`): its engines checked. The target's own engine dying is
    a one-line error (nothing is left to run); llama-server dying is said in one line, and it is left out:
    returns the engines left out."""
    if not timeout_s:
        return set()
    left_out = set()
    for verdict in check_engines(checks, timeout_s):
        if verdict.ok:
            continue
        if verdict.check.engine != LLAMA_SERVER.name:
            raise DraftlabError(verdict.line)
        print(f"{command}: {verdict.line}", file=sys.stderr)
        left_out.add(verdict.check.engine)
    return left_out


def check_engines(checks: list[EngineCheck], timeout_s: float = TIMEOUT_S) -> list[Verdict]:
    """Each check in its own child, one after the other (two children would time each other's load)."""
    return [check_engine(check, timeout_s) for check in dict.fromkeys(checks)]


def check_engine(check: EngineCheck, timeout_s: float = TIMEOUT_S) -> Verdict:
    """Run one check in a child; its verdict. The child is killed, with its process group, past `timeout_s`."""
    command = [sys.executable, "-m", "draftlab.contenders.preflight", json.dumps(asdict(check))]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    timeout_s = _fault_limit(check) or timeout_s
    try:
        _, err = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(child)
        return Verdict(check, f"{check.words()} did not decode {TOKENS} tokens within {timeout_s:.0f} s (a hang); "
                              f"left out: {REMEDY[check.engine]}")
    if child.returncode == 0:
        return Verdict(check)
    return Verdict(check, f"{check.words()} {_death(child.returncode, err)} while decoding {TOKENS} tokens; "
                          f"left out: {REMEDY[check.engine]}")


def _death(returncode: int, err: bytes) -> str:
    """How a child ended, in words: the signal that killed it, or its exit code and last error line."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    lines = [line for line in err.decode("utf-8", "replace").splitlines() if line.strip()]
    return f"exited with code {returncode}" + (f" ({lines[-1].strip()[:200]})" if lines else "")


def _kill_group(child: subprocess.Popen) -> None:
    """Kill a hung child and whatever it started (a llama-server), and reap it."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.communicate()


def _fault_mode(check: EngineCheck) -> str:
    """The fault `DRAFTLAB_PREFLIGHT_FAULT=ENGINE:MODE[:SOURCE]` asks of this check ('' when it names another)."""
    named, _, rest = os.environ.get(FAULT_ENV, "").partition(":")
    mode, _, source = rest.partition(":")
    return mode if named == check.engine and source in ("", check.source) else ""


def _fault_limit(check: EngineCheck) -> float:
    """A `hang=SECONDS` fault's own limit for this check (0 for none): a test's hang is judged by it, not by the
    limit every healthy engine keeps."""
    mode, _, seconds = _fault_mode(check).partition("=")
    if mode != "hang" or not seconds:
        return 0.0
    try:
        return max(float(seconds), 0.1)
    except ValueError:
        raise DraftlabError(f"{FAULT_ENV}: hang={seconds!r} is not a number of seconds") from None


def _fault(check: EngineCheck) -> None:
    """Die as `DRAFTLAB_PREFLIGHT_FAULT` says, when it names this engine (and source): tests."""
    mode = _fault_mode(check).partition("=")[0]
    if mode == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif mode == "hang":
        time.sleep(24 * 3600)
    elif mode == "exit":
        raise DraftlabError(f"{FAULT_ENV} asked this check to fail")


def _decode(check: EngineCheck) -> None:
    """In the child: load the target as the work will and decode a few tokens on every kernel set it will use."""
    target = load_model(check.source, device=check.device, dtype=check.dtype, backend=check.backend)
    ids = prompt_ids(target.tokenizer, Prompt("preflight", "check", "def fibonacci(n):"))
    _fault(check)
    if check.engine == LLAMA_SERVER.name:
        return _decode_on_server(target, ids)
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1, backend=check.backend)
    fastest = fastest_plain(plain)  # llama.cpp: its default kernels (repacked weights) beside the exact ones
    for decoder in [plain] if fastest is plain else [plain, fastest]:
        decoder.generate(ids, max_new_tokens=TOKENS)


def _decode_on_server(target, ids: list[int]) -> None:
    """In the child: start llama-server on the target's GGUF and ask it for a few tokens; a server that dies passes
    its signal on (the child dies of it), so the parent's line names it."""
    with tempfile.TemporaryDirectory() as logs:
        server = LlamaServer(spec_config(gguf_path(target.source), "none", 0), Path(logs))
        with server:
            try:
                server.completion(ids, RunSettings(TOKENS))
            except DraftlabError:
                code = server.process.poll() if server.process else None
                if code is not None and code < 0:
                    os.kill(os.getpid(), -code)
                raise


def main(argv: list[str]) -> int:
    """The child: one check, given as JSON; exit 0 when the engine decoded."""
    check = EngineCheck(**json.loads(argv[0]))
    try:
        _decode(check)
    except DraftlabError as exc:
        print(f"preflight: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

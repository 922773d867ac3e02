"""What every server draftlab starts shares (llama-server's, vLLM's): a free port of 127.0.0.1 only, a log file, a
start that waits until `/health` answers and stops the server when anything fails on the way, and the kernel's
signal to the server when the Python process that started it dies (`PR_SET_PDEATHSIG`), so none is left behind."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator

from draftlab.errors import DraftlabError

REQUEST_TIMEOUT_S = 600.0


class ServerExited(DraftlabError):
    """The server ended while a request was in flight (killed, crashed): nothing about the configuration."""


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the server's process before exec: the kernel sends it SIGTERM when the thread that started it ends (the
    main thread: when the process dies, however it dies)."""
    _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM))


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class ServedProcess:
    """A server process as a context manager (started on entry, stopped on exit; its log NAME-PORT.log in
    `log_dir`). Each server says how it starts (`launch`), why it exited at start and how it stops."""

    NAME: ClassVar[str]  # its log's prefix and its name in errors
    START_TIMEOUT_S: ClassVar[float]  # a start that has not answered by then is stuck
    config: Any  # its configuration (each server's own type)
    log_dir: Path
    port: int = 0  # 0: a free port of 127.0.0.1, chosen at start
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def log(self) -> Path:
        return self.log_dir / f"{self.NAME}-{self.port}.log"

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def prefill(self, prompt_ids: list[int]) -> None: ...  # the prompt's prefill: one request of one token

    def _start_failure(self) -> str: ...  # why it exited at start, in one line naming the log

    def save_prompt(self, name: str) -> None:
        """Write what its one slot holds (the prompt's cache) to the file `name` of its save directory."""
        raise DraftlabError(f"{self.NAME} cannot copy a prompt's cache")

    def load_prompt(self, name: str) -> None:
        """Make its one slot hold what `save_prompt` wrote to `name` (another server of its `PrefillShare`)."""
        raise DraftlabError(f"{self.NAME} cannot copy a prompt's cache")

    def launch(self, command: list[str], env: dict[str, str], own_group: bool = False) -> None:
        """Start `command` on a free loopback port (`own_group`: in a process group of its own, which `stop` then
        signals whole) and wait until it answers; a one-line error naming the cause and the log when it exits or
        does not answer in time (the server is stopped first)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(self.port)], stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            preexec_fn=die_with_parent, start_new_session=own_group,
                                            env={**os.environ, **env})
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def post(self, path: str, body: dict, api_key: str = "") -> dict:
        """One JSON request to the server and its JSON answer (with `api_key` as its bearer token); a one-line error
        when it refuses it, does not answer, or exited meanwhile (`ServerExited`)."""
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                         headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise DraftlabError(f"{self.NAME} refused the request ({exc.code}): "
                                f"{exc.read().decode(errors='replace')[:200]}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            if self.process is not None and self._exited():
                raise ServerExited(f"{self.NAME} exited during a request (code {self.process.returncode}); "
                                   f"log: {self.log}") from None
            raise DraftlabError(f"{self.NAME} did not answer a request ({exc}); log: {self.log}") from None

    def _exited(self, grace_s: float = 2.0) -> bool:
        """Whether the process ended (waiting a moment: a killed server closes its sockets before it is reaped)."""
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def memory_gib(self) -> float:
        """What the server's processes hold in memory now, its share of what they share counted once (their
        proportional set sizes, Linux's /proc); 0 once it stopped."""
        if self.process is None or self.process.poll() is not None:
            return 0.0
        return sum(_pss_kib(pid) for pid in _tree(self.process.pid)) / 2**20

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise DraftlabError(self._start_failure())
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise DraftlabError(f"{self.NAME} did not answer on 127.0.0.1:{self.port} within "
                            f"{self.START_TIMEOUT_S:.0f} s; log: {self.log}")


def available_gib() -> float:
    """The memory the host can still give without swapping (MemAvailable of /proc/meminfo)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    raise DraftlabError("/proc/meminfo says no MemAvailable")


def processes() -> Iterator[tuple[int, str, int, int]]:
    """Every process now: (pid, state, parent's pid, process group), from Linux's /proc/PID/stat (whose fields follow
    the command's name in parentheses); one that ends meanwhile is passed over."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                state, parent, group = stat.read().rsplit(")", 1)[1].split()[:3]
            yield int(pid), state, int(parent), int(group)
        except (OSError, ValueError):
            continue


def _tree(root: int) -> list[int]:
    """A process and all its descendants."""
    parents = {pid: parent for pid, _, parent, _ in processes()}
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def _pss_kib(pid: int) -> int:
    """A process's proportional set size in KiB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            return next((int(line.split()[1]) for line in rollup if line.startswith("Pss:")), 0)
    except (OSError, ValueError):
        return 0


@dataclass
class PrefillShare:
    """Servers of one build, file and context that differ only in their speculation (`group`): their prefill of a
    prompt is one computation. The server that prefilled the prompt last (`donor`) saves its slot once, to the
    group's one file (each prompt's replaces the last's), and every other server of the group loads that file
    instead of computing the prefill again."""

    group: str
    donor: Any = None  # the started server whose slot holds `prompt`
    prompt: tuple[int, ...] = ()
    saved: bool = False  # whether the donor wrote `prompt`'s file yet

    @property
    def name(self) -> str:
        """The group in short: its prefill key's tail and its file's name."""
        return hashlib.sha256(self.group.encode()).hexdigest()[:12]

    def hold(self, server: Any, prompt_ids: list[int]) -> None:
        """`server` has just prefilled the prompt: the others copy it from there."""
        self.donor, self.prompt, self.saved = server, tuple(prompt_ids), False

    def forget(self, server: Any) -> None:
        """`server` is stopping: a prompt's prefill it held is gone (the next server of the group computes it)."""
        if self.donor is server:
            self.donor, self.prompt, self.saved = None, (), False

    def copy_to(self, server: Any, prompt_ids: list[int]) -> None:
        """`server`'s slot made to hold the donor's prefill of the prompt (saved on the first copy)."""
        if self.donor is None or tuple(prompt_ids) != self.prompt:
            raise DraftlabError("no server of this group holds the prompt's prefill")
        if not self.saved:
            self.donor.save_prompt(f"prefill-{self.name}.bin")
            self.saved = True
        server.load_prompt(f"prefill-{self.name}.bin")


@dataclass(frozen=True)
class ServedRun:
    """A running server as a contender of the measurement loop (`draftlab.measure.Contender`): each server holds its
    own prompt cache; with `reuse`, a run starts from the prompt the loop's `prefill` left there (without: each
    request prefills, as under load)."""

    server: Any  # a started ServedProcess
    context_length: int  # a prompt and its answer that do not fit are refused, as draftlab's engine refuses them
    reuse: bool = True
    share: PrefillShare | None = None  # the servers its prefill is one computation with (None: its own)

    @property
    def reuses_prefill(self) -> bool:
        return self.reuse

    @property
    def prefill_key(self) -> str:
        """One per group of servers that share a prefill, else one per server; '' without reuse."""
        if not self.reuse:
            return ""
        return f"{self.server.NAME} {self.share.name}" if self.share else f"{self.server.NAME}:{self.server.port}"

    def prefill(self, prompt_ids: list[int]) -> None:
        """The server's prefill of the prompt (one request of one token), which the others of its share copy."""
        self.server.prefill(prompt_ids)
        if self.share:
            self.share.hold(self.server, prompt_ids)

    def take_prefill(self, prompt_ids: list[int]) -> None:
        """Its slot made to hold the prefill another server of its share computed (a copy of the cache)."""
        self.share.copy_to(self.server, prompt_ids)

    def forgetful(self) -> "ServedRun":
        """Itself: a request reuses only the same prompt's cached prefix (a server's own drafter may learn across
        requests, as it does where the server is deployed)."""
        return self

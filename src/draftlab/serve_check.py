"""`draftlab serve-check 'llama-server ...'`: re-measure a llama-server command on the user's prompts.

The command's server and the same server without its speculative flags (its own plain decoding) run side by side
on 127.0.0.1, and the measurement loop (`draftlab.measure`) sends every prompt to both, interleaved, after a
warm-up. The result: both speedups of the command over plain decoding, its drafted and accepted tokens, and how many
outputs equal plain decoding's. llama-server's default kernels round a block's rows apart from single rows, so its
speculation is lossless only up to rounding: differing outputs are counted and said, never assumed away.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from draftlab.errors import DraftlabError
from draftlab.llama_server import LlamaServer, ServerConfig
from draftlab.measure import DECODE, END_TO_END, EncodedPrompt, RunSettings, measure
from draftlab.models import gguf_path

PLAIN, COMMAND = "plain", "command"
# llama-server's flags draftlab reads (both spellings) -> ServerConfig's field; the rest pass through as they are.
FLAGS = {"-m": "model", "--model": "model", "-md": "draft", "--model-draft": "draft", "--spec-draft-model": "draft",
         "--spec-type": "spec_type", "--spec-draft-n-max": "draft_n_max", "--spec-draft-n-min": "draft_n_min",
         "--spec-draft-p-min": "draft_p_min", "--draft-p-min": "draft_p_min", "-t": "threads", "--threads": "threads",
         "-np": "slots", "--parallel": "slots", "-c": "context", "--ctx-size": "context"}
DROPPED = ("--host", "--port")  # draftlab serves on 127.0.0.1 and a free port
KINDS = {"draft_n_max": int, "draft_n_min": int, "draft_p_min": float, "threads": int, "slots": int, "context": int}


def parse_command(text: str) -> ServerConfig:
    """The configuration a llama-server command line runs (a one-line error for one draftlab cannot run)."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise DraftlabError(f"cannot read the command: {exc}") from None
    if words and Path(words[0]).name == "llama-server":
        words = words[1:]
    values: dict = {}
    extra: list[str] = []
    i = 0
    while i < len(words):
        flag = words[i]
        if flag in FLAGS or flag in DROPPED:
            if i + 1 >= len(words):
                raise DraftlabError(f"{flag} needs a value in the command")
            if flag in FLAGS:
                values[FLAGS[flag]] = _value(FLAGS[flag], words[i + 1])
            i += 2
            continue
        extra.append(flag)
        i += 1
    if "model" not in values:
        raise DraftlabError("the command names no model: give -m MODEL.gguf (or a draftlab short name)")
    return ServerConfig(extra=tuple(extra), **values)


def _value(field: str, text: str):
    if field in ("model", "draft"):
        return gguf_path(text)
    if field == "spec_type":
        return text
    try:
        return KINDS[field](text)
    except ValueError:
        raise DraftlabError(f"{field.replace('_', '-')} needs a number in the command, got {text!r}") from None


@dataclass
class ServeCheck:
    """The command against its own plain decoding on the same prompts."""

    command: str
    plain_command: str
    prompts: int
    tokens_per_s: dict  # PLAIN / COMMAND -> end-to-end tokens/s
    speedup: float | None  # end to end
    decode_speedup: float | None
    identical: int  # outputs equal to the plain server's (greedy)
    drafted: int
    accepted: int

    def verdict(self) -> str:
        """One sentence for people."""
        lossless = ("every output identical to its plain decoding" if self.identical == self.prompts else
                    f"{self.prompts - self.identical} of {self.prompts} outputs differ from its plain decoding "
                    "(llama-server's kernels round a block's rows apart from single rows: equal only up to rounding)")
        pays = "pays" if (self.speedup or 0) > 1 else "does not pay"
        return (f"the command {pays} here: {self.speedup:.2f}x plain decoding end to end, "
                f"{self.decode_speedup:.2f}x decode only, over {self.prompts} prompts; {lossless}")


def plain_of(config: ServerConfig) -> ServerConfig:
    """The same server without speculation (the flags draftlab knows as speculative are dropped)."""
    extra = tuple(flag for flag in config.extra if not flag.startswith("--spec-"))
    return replace(config, spec_type="", draft=None, draft_n_max=None, draft_n_min=None, draft_p_min=None,
                   extra=extra)


def serve_check(config: ServerConfig, prompts: list[EncodedPrompt], settings: RunSettings, log_dir: Path,
                progress: bool = True) -> ServeCheck:
    """Start the command's server and its plain twin, measure both on every prompt, stop both."""
    plain = plain_of(config)
    context = config.context // config.slots
    with LlamaServer(plain, log_dir) as plain_server, LlamaServer(config, log_dir) as server:
        measured = measure({PLAIN: plain_server.contender(context), COMMAND: server.contender(context)}, prompts,
                           settings, warmup=1, progress="serve-check" if progress else "")
    runs, baseline = measured.records[COMMAND], measured.records[PLAIN]
    return ServeCheck(config.command(), plain.command(), len(runs),
                      {key: measured.tokens_per_s(key, END_TO_END) for key in (PLAIN, COMMAND)},
                      measured.speedup(COMMAND, PLAIN, END_TO_END), measured.speedup(COMMAND, PLAIN, DECODE),
                      sum(a.token_ids == b.token_ids for a, b in zip(runs, baseline)),
                      sum(r.stats.drafted for r in runs), sum(r.stats.accepted for r in runs))


def as_dict(check: ServeCheck) -> dict:
    """For JSON."""
    return asdict(check)

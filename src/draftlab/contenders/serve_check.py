"""`draftlab serve-check 'llama-server ...'`: re-measure a llama-server command on the user's prompts, alone and under
load.

The command's server and the same server without its speculative flags (its own plain decoding) run side by side
on 127.0.0.1, and the measurement loop (`draftlab.measure`) sends every prompt to both, interleaved, after a
warm-up. The result: both speedups of the command over plain decoding, its drafted and accepted tokens, and how many
outputs equal plain decoding's. llama-server's default kernels round a block's rows apart from single rows, so its
speculation is lossless only up to rounding: differing outputs are counted and said, never assumed away.

Under load (`--concurrency 1,2,4`) both servers get that many slots and that many requests in flight
(`draftlab.measure.measure_load`): aggregate tokens/s and each request's latency per level, and up to which
concurrency the command pays, also in the shape vLLM's `num_speculative_tokens_per_batch_size` takes.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from draftlab.backends.engines import LLAMA_SERVER
from draftlab.contenders.llama_server import LlamaServer, ServerConfig
from draftlab.errors import DraftlabError
from draftlab.measure import DECODE, END_TO_END, EncodedPrompt, RunSettings, measure, measure_load
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
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=VALUE before the binary
        words = words[1:]  # (draftlab starts every server with its kernel settings: ServerConfig.env)
    if words and Path(words[0]).name == LLAMA_SERVER.name:
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
    """The same server without speculation (the flags draftlab knows as speculative are dropped, with their values:
    `--spec-ngram-mod-n-max 16` goes whole)."""
    extra, words = [], list(config.extra)
    while words:
        word = words.pop(0)
        if not word.startswith("--spec-"):
            extra.append(word)
        elif words and not words[0].startswith("-"):
            words.pop(0)  # the speculative flag's value
    return replace(config, spec_type="", draft=None, draft_n_max=None, draft_n_min=None, draft_p_min=None,
                   extra=tuple(extra))


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


@dataclass(frozen=True)
class LoadLevel:
    """The command and its plain decoding at one concurrency."""

    concurrency: int
    plain_tokens_per_s: float  # aggregate
    command_tokens_per_s: float
    plain_latency_s: float  # mean per request
    command_latency_s: float
    identical: int  # outputs equal to the plain server's at this concurrency
    prompts: int

    @property
    def speedup(self) -> float:
        """Aggregate tokens/s of the command over plain decoding's."""
        return self.command_tokens_per_s / self.plain_tokens_per_s if self.plain_tokens_per_s else 0.0


def serve_check_load(config: ServerConfig, prompts: list[EncodedPrompt], settings: RunSettings, levels: list[int],
                     log_dir: Path) -> list[LoadLevel]:
    """At each concurrency: both servers with that many slots (the same context per slot), every prompt sent with
    that many requests in flight, plain decoding first."""
    per_slot = config.context // config.slots
    out = []
    for concurrency in levels:
        sized = replace(config, slots=concurrency, context=per_slot * concurrency)
        with LlamaServer(plain_of(sized), log_dir) as plain_server, LlamaServer(sized, log_dir) as server:
            runs = measure_load({PLAIN: plain_server.contender(per_slot), COMMAND: server.contender(per_slot)},
                                prompts, settings, concurrency)
        plain, command = runs[PLAIN], runs[COMMAND]
        out.append(LoadLevel(concurrency, plain.tokens_per_s, command.tokens_per_s, plain.latency_s,
                             command.latency_s, sum(a.token_ids == b.token_ids
                                                    for a, b in zip(command.records, plain.records)), len(prompts)))
    return out


def pays_up_to(levels: list[LoadLevel]) -> int:
    """The highest measured concurrency up to which the command is faster than plain decoding at every level (0:
    not even alone)."""
    best = 0
    for level in sorted(levels, key=lambda x: x.concurrency):
        if level.speedup <= 1.0:
            break
        best = level.concurrency
    return best


def level_pays(levels: list[LoadLevel]) -> list[tuple[int, bool]]:
    """(concurrency, whether the command pays there) per level: up to `pays_up_to`, not beyond; the rows of its
    `deploy.per_batch_size` table."""
    pays = pays_up_to(levels)
    return [(level.concurrency, level.concurrency <= pays) for level in sorted(levels, key=lambda x: x.concurrency)]


def as_dict(check: ServeCheck, levels: list[LoadLevel] = ()) -> dict:
    """For JSON."""
    return {**asdict(check), "load": [{**asdict(level), "speedup": level.speedup} for level in levels]}

"""The tuner's last round on llama-server: its pick beside llama-server's plain decoding and the server's own
speculative types, on the same prompts in the same run, and the answer as a llama-server command line.

Every contender goes through the measurement loop (interleaved per prompt, order rotated, after a warm-up); each
server configuration is its own server start (`draftlab.contenders.server_configs`), stopped when the round ends however it
ends. The server's speculation is compared with its own plain decoding output by output: its kernels round a
block's rows apart from single rows, so it is lossless only up to rounding, and the round says how many outputs
differed rather than ranking it with draftlab's exact configurations.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draftlab.files.datasets import Prompt
from draftlab.measure import DECODE, END_TO_END, RunSettings, measure
from draftlab.models import LoadedModel, gguf_path
from draftlab.perf.halving import encode, race_decoder
from draftlab.contenders.server_configs import ServerPool, parse_server_spec, spec_config
from draftlab.drafters.kinds import is_plain_drafter

DRAFTLAB_PLAIN, SERVER_PLAIN = "draftlab plain decoding", "llama-server plain decoding"


@dataclass(frozen=True)
class ServerRound:
    """The round's figures per contender (labels), and the server configuration to deploy."""

    tokens_per_s: dict[str, float]  # end to end
    decode_tokens_per_s: dict[str, float | None]
    identical: dict[str, int]  # outputs equal to the server's plain decoding (greedy)
    prompts: int
    deploy: str  # the label of the server configuration to deploy (its plain decoding when no type beats it)
    command: str  # its llama-server command line

    def lines(self) -> list[str]:
        """The round for people: each contender against the server's plain decoding, then the command."""
        plain = self.tokens_per_s[SERVER_PLAIN]
        out = [f"llama-server round ({self.prompts} prompt(s), end-to-end tok/s, ratio to llama-server's plain "
               "decoding; identical: outputs equal to it):"]
        for name, speed in sorted(self.tokens_per_s.items(), key=lambda item: -item[1]):
            decode = self.decode_tokens_per_s.get(name)
            rounding = " (lossless only up to rounding)" if name.startswith("llama-server ") and \
                name != SERVER_PLAIN else ""
            out.append(f"  {name:<44}{speed:>7.1f} tok/s  {speed / plain:.2f}x  decode "
                       f"{decode or 0:.1f} tok/s  identical {self.identical[name]}/{self.prompts}{rounding}")
        out.append(f"deploy ({self.deploy}): {self.command}")
        return out


def server_round(target: LoadedModel, pick: tuple[str, int], specs: list[str], prompts: list[Prompt],
                 max_new_tokens: int, log_dir: Path, progress: bool = True) -> ServerRound:
    """draftlab's plain decoding and its pick (`(draft, K)`) on the target, llama-server's plain decoding and every
    configuration of `specs` ('TYPE[/DRAFT][:K,...]') on the target's GGUF, measured together."""
    model = gguf_path(target.source)
    configs = {f"llama-server {drafter}" + (f" K={k}" if k else ""): (drafter, k)
               for spec in map(parse_server_spec, specs) for drafter, k in spec.configurations()}
    pool = ServerPool(log_dir)
    try:
        contenders = {DRAFTLAB_PLAIN: race_decoder(target, "none", 1, target.engine.backend),
                      SERVER_PLAIN: pool.contender(spec_config(model, "none", 0))}
        if not is_plain_drafter(pick[0]):
            contenders[f"draftlab {pick[0]} K={pick[1]}"] = race_decoder(target, *pick, target.engine.backend)
        contenders.update({name: pool.contender(spec_config(model, *config)) for name, config in configs.items()})
        measured = measure(contenders, encode(target, prompts), RunSettings(max_new_tokens), warmup=1,
                           progress="llama-server round" if progress else "")
    finally:
        pool.stop_all()
    speeds = {name: measured.tokens_per_s(name, END_TO_END) or 0.0 for name in contenders}
    plain = measured.records[SERVER_PLAIN]
    identical = {name: sum(a.token_ids == b.token_ids for a, b in zip(measured.records[name], plain))
                 for name in contenders}
    best = max(configs, key=lambda name: speeds[name], default=SERVER_PLAIN)
    deploy = best if speeds.get(best, 0.0) > speeds[SERVER_PLAIN] else SERVER_PLAIN
    drafter, k = configs.get(deploy, ("none", 0))
    return ServerRound(speeds, {name: measured.tokens_per_s(name, DECODE) for name in contenders}, identical,
                       len(plain), deploy, spec_config(model, drafter, k).command())

"""How a target's per-token costs grow with the context, for a study's plan (`study/run/budget.py`).

The pilot times every cell on the group's median-length prompt, `PILOT_TOKENS` new tokens each. A prompt ten times
longer costs more than ten times its prefill (each token attends to every earlier one), and each new token after it
attends to more cells too; a 128-token answer's tokens attend to more cells than the pilot's first 16. Where the
group's longest prompt is `SPAN` times the pilot's or longer, the pilot times the target's baseline on it as well:
its prefill per prompt token and its new tokens' seconds against theirs on the pilot's prompt give a relative growth
per token of context, which the plan applies to every engine and cell of that target (they run the same model's
attention over the same contexts)."""

from __future__ import annotations

from dataclasses import dataclass

SPAN = 2.0  # the longest prompt, in the pilot prompt's lengths, from which the growth is timed
FLOOR = 0.5  # the least a factor falls to below the pilot's context (a prompt shorter than the pilot's)


@dataclass(frozen=True)
class Growth:
    """A target's per-token costs against the context: relative growth per token of context beyond the pilot's
    (0: not timed, every prompt priced at the pilot's rates)."""

    at: int = 0  # the pilot prompt's tokens
    new_tokens: int = 0  # the pilot's new tokens per cell
    longest: int = 0  # the prompt the baseline was timed on again (0: none)
    prefill: float = 0.0  # a prompt token's prefill seconds: relative growth per token of the prompt's length
    decode: float = 0.0  # a new token's seconds: relative growth per token of context before it

    @classmethod
    def timed(cls, at: int, new_tokens: int, longest: int, prefill: tuple[float, float], decode: tuple[float, float]
              ) -> "Growth":
        """From the baseline's seconds per prompt token (`prefill`) and per new token (`decode`), each (on the pilot's
        prompt of `at` tokens, on the longest of `longest`); a cost timed lower on the longer prompt (noise) grows
        by nothing."""
        span = longest - at
        if span <= 0 or min(*prefill, *decode) <= 0:
            return cls()
        return cls(at, new_tokens, longest, max(prefill[1] / prefill[0] - 1, 0.0) / span,
                   max(decode[1] / decode[0] - 1, 0.0) / span)

    def prefill_factor(self, length: int) -> float:
        """A prompt of `length` tokens: its prefill's seconds per token against the pilot prompt's."""
        return max(1.0 + self.prefill * (length - self.at), FLOOR)

    def decode_factor(self, length: int, new_tokens: int) -> float:
        """`new_tokens` decoded after a prompt of `length` tokens: seconds per new token against the pilot's (each
        at its mean context: the prompt and half its new tokens)."""
        context, pilot = length + new_tokens / 2, self.at + self.new_tokens / 2
        return max(1.0 + self.decode * (context - pilot), FLOOR)

    def words(self) -> str:
        """What was timed, for the plan's line ('' where nothing was)."""
        if not self.longest:
            return ""
        return (f"a prompt token's prefill {self.prefill_factor(self.longest):.2f}x and a new token "
                f"{self.decode_factor(self.longest, self.new_tokens):.2f}x on the longest prompt ({self.longest} "
                f"tokens) against the pilot's ({self.at})")

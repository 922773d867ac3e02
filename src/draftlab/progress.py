"""draftlab's progress bars, on standard error (no third-party bar).

On a terminal a bar redraws its one line in place, at most every `REDRAW_S`; in a log (not a terminal: CI, a
pipe, a file) it writes a line at each tenth of the work and at least every `LOG_EVERY_S`, so a log stays short.

    for prompt in track(prompts, "bench", unit="prompt"):
        ...

    with Bar(total=steps, desc="train", unit="step") as bar:
        bar.update(); bar.describe("loss 2.31")
"""

from __future__ import annotations

import sys
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import TextIO, TypeVar

REDRAW_S = 0.25  # a terminal's bar redraws at most this often
LOG_EVERY_S = 60.0  # a log gets a line at least this often while work goes on
WIDTH = 24  # characters of the bar itself

T = TypeVar("T")


@dataclass
class Bar:
    """One bar: `update` counts work done, `describe` sets the text after it, `close` draws it a last time."""

    total: int | None  # units of work; None when unknown (the bar shows a count and a rate only)
    desc: str
    unit: str = "it"
    disable: bool = False
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    n: int = 0  # units done
    note: str = ""
    started: float = field(default_factory=time.monotonic)
    _drawn_at: float = float("-inf")
    _logged_tenth: int = -1
    _logged_n: int = -1  # units done at the last line written to a log
    _closed: bool = False

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        """Count `n` more units done; redraw when due."""
        self.n += n
        self._draw(final=False)

    def describe(self, text: str) -> None:
        """The text after the bar (what runs now); shown at the next redraw."""
        self.note = text

    def close(self) -> None:
        """Draw the bar a last time and end its line (once)."""
        if not self._closed:
            self._closed = True
            self._draw(final=True)

    def line(self) -> str:
        """The bar as text: `desc: 45%|##########          | 9/20 [00:12<00:15, 0.75 run/s] note`."""
        elapsed = time.monotonic() - self.started
        rate = self.n / elapsed if elapsed > 0 else 0.0
        speed = f"{rate:.2f} {self.unit}/s" if rate >= 1 or rate == 0 else f"{1 / rate:.1f} s/{self.unit}"
        if not self.total:
            return f"{self.desc}: {self.n} {self.unit} [{_clock(elapsed)}, {speed}] {self.note}".rstrip()
        share = min(1.0, self.n / self.total)
        filled = int(share * WIDTH)
        left = (self.total - self.n) / rate if rate > 0 else None
        eta = _clock(left) if left is not None else "?"
        return (f"{self.desc}: {share:4.0%}|{'#' * filled}{' ' * (WIDTH - filled)}| {self.n}/{self.total} "
                f"[{_clock(elapsed)}<{eta}, {speed}] {self.note}").rstrip()

    def _draw(self, final: bool) -> None:
        """Redraw in place on a terminal; write a line per tenth (or per LOG_EVERY_S) in a log."""
        if self.disable:
            return
        now = time.monotonic()
        if _is_terminal(self.stream):
            if final or now - self._drawn_at >= REDRAW_S:
                self.stream.write("\r" + self.line() + ("\n" if final else "\x1b[K"))
                self.stream.flush()
                self._drawn_at = now
            return
        tenth = int(10 * self.n / self.total) if self.total else -1
        due = tenth > self._logged_tenth or now - self._drawn_at >= LOG_EVERY_S
        if (final and self.n != self._logged_n) or due:
            self.stream.write(self.line() + "\n")
            self.stream.flush()
            self._drawn_at, self._logged_tenth, self._logged_n = now, tenth, self.n


def track(items: Collection[T], desc: str, unit: str = "it", disable: bool = False,
          stream: TextIO | None = None) -> Iterator[T]:
    """Each item of `items`, with a bar counting them."""
    bar = Bar(len(items), desc, unit, disable, stream or sys.stderr)
    with bar:
        for item in items:
            yield item
            bar.update()


def _is_terminal(stream: TextIO) -> bool:
    """True when the stream is a terminal (a bar can redraw its line there)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or bare stream: write lines
        return False


def _clock(seconds: float) -> str:
    """Seconds as MM:SS, or H:MM:SS from an hour."""
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:02d}:{rest % 60:02d}"

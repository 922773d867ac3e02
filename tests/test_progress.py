"""draftlab's own progress bars: a line per tenth in a log, one redrawn line on a terminal, nothing when disabled."""

import io

from draftlab.progress import Bar, track


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_per_tenth_and_a_last_line():
    log = io.StringIO()
    items = list(track(range(100), "sweep", unit="run", stream=log))
    lines = log.getvalue().splitlines()
    assert items == list(range(100))
    assert len(lines) == 11  # the first unit and each tenth (close adds no line: nothing changed since the last)
    assert lines[0].startswith("sweep:   1%|") and "1/100" in lines[0]
    assert lines[-1].startswith("sweep: 100%|" + "#" * 24 + "|") and "100/100" in lines[-1]
    assert all("\r" not in line for line in lines)


def test_a_terminal_redraws_one_line_in_place():
    screen = Terminal()
    with Bar(total=3, desc="train", unit="step", stream=screen) as bar:
        for loss in (3.0, 2.0, 1.0):
            bar.update()
            bar.describe(f"loss {loss:.1f}")
    text = screen.getvalue()
    assert text.startswith("\rtrain:  33%|") and text.endswith("\n") and text.count("\n") == 1
    assert text.rstrip("\n").rsplit("\r", 1)[-1].startswith("train: 100%|")
    assert text.rstrip("\n").endswith("loss 1.0")


def test_a_disabled_bar_writes_nothing_and_still_counts():
    log = io.StringIO()
    bar = Bar(total=5, desc="x", disable=True, stream=log)
    bar.update(5)
    bar.close()
    assert log.getvalue() == "" and bar.n == 5


def test_a_bar_resumes_from_work_already_done_and_shows_units_per_second_or_seconds_per_unit():
    bar = Bar(total=10, desc="train", unit="step", n=4, stream=io.StringIO())
    assert "4/10" in bar.line()
    bar.started -= 8.0  # 4 steps in 8 s: 2 s a step, 12 s left
    line = bar.line()
    assert "2.0 s/step" in line and "<00:12" in line
    fast = Bar(total=None, desc="calibrate", unit="draft", n=30, stream=io.StringIO())
    fast.started -= 10.0
    assert fast.line().startswith("calibrate: 30 draft [00:10, 3.00 draft/s]")


def test_a_bar_closes_once_even_when_its_work_fails():
    log = io.StringIO()
    try:
        for i in track([1, 2, 3], "prompts", stream=log):
            if i == 2:
                raise ValueError("bad prompt")
    except ValueError:
        pass
    lines = log.getvalue().splitlines()
    assert lines[-1].startswith("prompts:  33%|") and "1/3" in lines[-1]

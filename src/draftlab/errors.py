"""The one exception type that draftlab raises for bad input.

Every message says what went wrong and what to do about it; the CLI prints it
on one line and exits non-zero.
"""


class DraftlabError(Exception):
    """A user-facing error: bad input, a missing file, an incompatible pair."""

    exit_code = 2  # the CLI's exit status for it


class NothingToMeasure(DraftlabError):
    """Every engine of a study failed its preflight (each said in its own line before): the input was fine, the
    engines were not, so the CLI exits 1."""

    exit_code = 1

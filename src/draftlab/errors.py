"""The one exception type that draftlab raises for bad input.

Every message says what went wrong and what to do about it; the CLI prints it
on one line and exits non-zero.
"""


class DraftlabError(Exception):
    """A user-facing error: bad input, a missing file, an incompatible pair."""

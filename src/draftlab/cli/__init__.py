"""The `draftlab` command line: one module per group of subcommands (main, study, tune, design)."""

from draftlab.cli.main import main

__all__ = ["main"]

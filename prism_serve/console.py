"""Where the command-line tools print their tables."""

from __future__ import annotations

import sys

from rich.console import Console


def stdout_console() -> Console:
    """Tables to stdout: the terminal's width, or 200 columns when piped (no name cut short)."""
    return Console(width=None if sys.stdout.isatty() else 200)

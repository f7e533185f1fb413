"""Output shared by the command modules."""

from __future__ import annotations

from rich.console import Console


def stdout() -> Console:
    """Standard output; wide enough for the tables when it is not a terminal (CI logs, pipes)."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    return console

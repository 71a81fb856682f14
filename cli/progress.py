"""The CLI's consoles and its one progress bar (description, bar, done/total, extra
columns, times)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["cli_console", "step_progress"]


def cli_console(*, stderr: bool = False, width: int | None = None) -> Console:
    """The console every command prints through. Lines are not broken at the terminal's
    width (soft wrap): a path or a command line printed whole can be copied whole, and
    is the same on any terminal; tables still fit the width."""
    return Console(stderr=stderr, width=width, soft_wrap=True)


def step_progress(console: Console, *fields: str, disable: bool = False) -> Progress:
    """A bar counted in steps; each of ``fields`` is a rich format string shown after
    the count (e.g. ``"loss {task.fields[loss]}"``)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    *(TextColumn(f) for f in fields), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console, disable=disable,
                    transient=False)

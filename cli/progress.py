"""The one progress bar of the CLI: description, bar, done/total, extra columns, times."""

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

__all__ = ["step_progress"]


def step_progress(console: Console, *fields: str, disable: bool = False) -> Progress:
    """A bar counted in steps; each of ``fields`` is a rich format string shown after
    the count (e.g. ``"loss {task.fields[loss]}"``)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    *(TextColumn(f) for f in fields), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console, disable=disable,
                    transient=False)

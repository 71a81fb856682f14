"""Terminal tables that never cut a figure: rich's default ends a cell that does not fit
in "..." (a run's "320.4" showed as "320..." at 80 columns)."""

from __future__ import annotations

from collections.abc import Collection

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

__all__ = ["keep_figures"]


def _width(cell: object) -> int:
    text = cell.plain if isinstance(cell, Text) else str(cell)
    return max((len(line) for line in text.splitlines()), default=0)


#: the narrowest a text column is made before columns are left out
_TEXT_MIN = 8


def _needed(table: Table) -> int:
    """The table's width with its figure columns as fixed and its text columns at
    :data:`_TEXT_MIN`: each column has a space either side and a rule after it."""
    return 1 + sum((c.width if c.width is not None else _TEXT_MIN) + 3 for c in table.columns)


def keep_figures(table: Table, console: Console,
                 whole: Collection[str] = ()) -> RenderableType:
    """``table`` (rows added) fitted to ``console`` without cutting a cell.

    Every cell wraps instead of ending in "...": words wrap, a word longer than its
    column folds onto the next line. Where the table is wider than the console, a
    right-justified column (one of figures), and the columns headed as in ``whole``
    (addresses, say), get a fixed width: their widest cell, or their header's longest
    word, so a number stays whole on one line and the text columns (names) share the
    rest of the room. Where even that does not fit, columns are left out from the
    right, and a note under the table names them.
    """
    unbounded = console.options.update_width(1 << 16)  # measured within the console: <= it
    squeeze = console.measure(table, options=unbounded).maximum > console.width
    for column in table.columns:
        column.overflow = "fold"
        column.no_wrap = False
        if squeeze and (column.justify == "right" or str(column.header) in whole):
            widest = max((_width(c) for c in column.cells), default=0)
            header = max((len(w) for w in str(column.header).split()), default=0)
            column.width = max(widest, header)
    dropped: list[str] = []
    while len(table.columns) > 1 and _needed(table) > console.width:
        dropped.insert(0, str(table.columns.pop().header))
    if not dropped:
        return table
    note = Text(f"({len(dropped)} column(s) left out at {console.width} characters wide: "
                f"{', '.join(dropped)}; a wider terminal shows them)", style="dim")
    return Group(table, note)

"""What a script may log (``opt.log``): the one rule, for the worker that writes the
figures and for the launcher that reads them back.

* The fields ``DistributedOptimizer`` writes itself in a ``step`` or ``eval`` record
  (:data:`STEP_FIELDS`, :data:`EVAL_FIELDS`) are its own: a figure a script logs
  under one of those names is dropped, with one warning (:func:`reserved`), and a
  record read back never lets a figure stand in for them.
* Only finite numbers are kept: NaN, Inf and anything not a number are dropped.
* Names are bounded: at most :data:`MAX_NAME` characters, and at most
  :data:`MAX_FIGURES` distinct names per worker (every name is a Prometheus series
  and a TensorBoard tag, and every periodic ``metrics`` record lists them); past
  that, one warning and the new names are dropped.

:class:`FigureGate` applies the last two rules, warning once for each kind of drop.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["EVAL_FIELDS", "MAX_FIGURES", "MAX_NAME", "STEP_FIELDS", "FigureGate", "reserved"]

log = logging.getLogger(__name__)

#: the fields of a worker's ``step`` record that DistributedOptimizer writes itself
#: (docs/events.md); any other number in it is a figure the script logged after the step
STEP_FIELDS = frozenset({
    "t", "event", "worker", "clock", "read_versions", "staleness", "accepted", "reasons",
    "weight", "num_samples", "compute_s", "sleep_s", "pull_s", "push_s", "wait_s", "bytes",
    "local_steps"})
#: the fields of an ``eval`` record that are not held-out figures
EVAL_FIELDS = frozenset({"t", "event", "worker", "clock", "versions", "final"})
#: distinct figure names kept per worker (training and held-out ones together)
MAX_FIGURES = 64
#: the longest figure name kept
MAX_NAME = 64


def reserved(name: str, held_out: bool) -> bool:
    """Whether ``name`` is a field the optimizer writes in the record it would join."""
    return name in (EVAL_FIELDS if held_out else STEP_FIELDS)


def finite(value: Any) -> float | None:
    """``value`` as a finite float; None if it is not a finite number (bools are not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


class FigureGate:
    """One worker's logged figures, by name: keeps finite numbers under names it has
    room for, and says once per kind of drop what it dropped."""

    def __init__(self, who: str, limit: int = MAX_FIGURES) -> None:
        self.who = who
        self.limit = limit
        self.names: set[str] = set()
        self._warned: set[str] = set()

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("%s: %s", self.who, message)

    def unreserved(self, figures: Mapping[str, Any], held_out: bool) -> dict[str, Any]:
        """``figures`` without the names the optimizer writes in the record they join
        (a figure never overwrites them; the first such name is warned of)."""
        out = {}
        for name, value in figures.items():
            if reserved(name, held_out):
                self._warn("reserved", f"logged figure {name!r} is a field the optimizer "
                                       "writes itself; it and any such are dropped (give "
                                       "the figure another name)")
            else:
                out[name] = value
        return out

    def admit(self, figures: Mapping[Any, Any]) -> dict[str, float]:
        """The figures to keep (``figures`` maps names to values)."""
        out: dict[str, float] = {}
        for name, value in figures.items():
            if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
                self._warn("name", f"a logged figure's name must be 1 to {MAX_NAME} "
                                   f"characters; {str(name)[:80]!r} and any such are dropped")
                continue
            number = finite(value)
            if number is None:
                self._warn("finite", f"logged figure {name}={value!r} is not a finite "
                                     "number; such figures are dropped")
                continue
            if name not in self.names:
                if len(self.names) >= self.limit:
                    self._warn("cap", f"more than {self.limit} distinct logged figure names; "
                                      f"{name!r} and any new ones are dropped")
                    continue
                self.names.add(name)
            out[name] = number
        return out

"""JSONL event logs: one JSON object per line, one file per process.

Every record has ``t`` (wall-clock seconds since the epoch), ``event`` (its
kind) and the fields of that kind; see docs/events.md for the schema.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paramserver.observe.console import Sink

__all__ = ["EventLog", "read_events", "write_json"]

log = logging.getLogger(__name__)


class EventLog:
    """Append-only JSONL writer; a no-op when ``path`` is None. A ``console`` is shown
    the records it prints a line for (with or without a file): the log and the
    console tell the same story."""

    def __init__(self, path: str | Path | None, *, flush_every: float = 0.5,
                 console: Sink | None = None) -> None:
        self.path = Path(path) if path else None
        self.console = console
        self._fh: IO[str] | None = None
        self._flush_every = flush_every
        self._last_flush = 0.0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("a", encoding="utf-8")
            if _ends_torn(self.path):
                # a killed predecessor (a restarted worker's) left half a record: end
                # that line, or our first record would be glued to it and lost
                self._fh.write("\n")

    def write(self, event: str, **fields: Any) -> None:
        console = self.console
        if console is not None and event not in console.events:
            console = None  # (a push's record, on the hot path: not a console line)
        if self._fh is None and console is None:
            return
        now = time.time()
        if self._fh is not None:
            self._fh.write(json.dumps({"t": now, "event": event, **fields},
                                      separators=(",", ":")) + "\n")
            if now - self._last_flush >= self._flush_every:
                self._fh.flush()
                self._last_flush = now
        if console is not None:
            try:
                console.show(event, fields, now)
            except Exception:  # a console must not take the process down
                log.exception("console line for %r failed", event)

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _ends_torn(path: Path) -> bool:
    """Whether a non-empty file's last byte is not a newline."""
    with path.open("rb") as fh:
        if fh.seek(0, 2) == 0:
            return False
        fh.seek(-1, 2)
        return fh.read(1) != b"\n"


def read_events(path: str | Path, event: str | None = None) -> list[dict[str, Any]]:
    """All records of a JSONL log (optionally only one kind); a torn last line is skipped."""
    out = []
    with Path(path).open(encoding="utf-8") as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event is None or rec.get("event") == event:
                out.append(rec)
    return out


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Write atomically: a reader never sees half a file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, target)

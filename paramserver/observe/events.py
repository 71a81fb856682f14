"""JSONL event logs: one JSON object per line, one file per process.

Every line has ``t`` (wall-clock seconds since the epoch), ``event`` (its kind)
and the fields of that kind: one of the records of
:mod:`paramserver.observe.records`, which docs/events.md describes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, get_args

import msgspec

from paramserver.observe.records import Event, kind_of

if TYPE_CHECKING:
    from paramserver.observe.console import Sink

__all__ = ["EventLog", "encode", "fields_of", "read_events", "write_json"]

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode
# where msgspec's JSON could differ from json.dumps' (which the logs have always
# been written with): a float in exponent notation (1e-05, 1e+16) or below 1e-4,
# a character json.dumps escapes (non-ASCII, DEL). There the record is written as
# json.dumps writes it, so a log's bytes do not depend on the path taken.
_ODD = re.compile(rb"[0-9]e|0\.0000|[^ -~]")


class _Shape:
    """What the writer needs of a record type, worked out once."""

    def __init__(self, cls: type[Event]) -> None:
        fields = msgspec.structs.fields(cls)
        names = [f.name for f in fields]
        self.flat = cls.flat
        # the flat map written in place of the record's last field: spliced in
        self.flat_last = self.flat is not None and names[-1] == self.flat
        # NaN and Infinity, which msgspec writes as null, can only be in these
        self.floats = tuple(f.name for f in fields if float in (f.type, *get_args(f.type)))
        self.open = self.flat is not None or any(
            f.type is not float and (_is_map(f.type) or any(_is_map(a) for a in get_args(f.type)))
            for f in fields)


def _is_map(tp: Any) -> bool:
    return tp is dict or getattr(tp, "__origin__", None) is dict or tp is Any


_SHAPES: dict[type[Event], _Shape] = {}


def fields_of(record: Event) -> dict[str, Any]:
    """The record's fields as its line holds them (no ``t``, no ``event``)."""
    out: dict[str, Any] = {}
    flat = record.flat
    for name in record.__struct_fields__:
        value = getattr(record, name)
        if name == flat:
            out.update(value)
        elif value is not msgspec.UNSET:
            out[name] = value
    return out


def _exact(record: Event, t: float) -> bytes:
    """The line as json.dumps writes it (NaN as NaN, 1e-05, \\u00e9)."""
    line = json.dumps({"t": t, "event": kind_of(record), **fields_of(record)},
                      separators=(",", ":"))
    return line.encode() + b"\n"


def encode(record: Event, t: float) -> bytes:
    """One line of an event log: ``record`` written at ``t``."""
    if not isinstance(record, Event):
        raise TypeError(f"an event log writes records of paramserver.observe.records, "
                        f"not {type(record).__name__}")
    shape = _SHAPES.get(type(record))
    if shape is None:
        shape = _SHAPES[type(record)] = _Shape(type(record))
    if shape.flat is not None:
        if not shape.flat_last:
            return _exact(record, t)
        extra = getattr(record, shape.flat)
        body = _encode(msgspec.structs.replace(record, **{shape.flat: {}}))
        body = body[:-len(shape.flat) - 7] + (b"," + _encode(extra)[1:] if extra else b"}")
    else:
        body = _encode(record)
    if _ODD.search(body) is not None:
        return _exact(record, t)
    if b"null" in body:
        if shape.open:  # a NaN may be anywhere in a map
            return _exact(record, t)
        for name in shape.floats:
            value = getattr(record, name)
            if isinstance(value, float) and not math.isfinite(value):
                return _exact(record, t)
    return b'{"t":' + repr(t).encode() + b"," + body[1:] + b"\n"


class EventLog:
    """Append-only JSONL writer; a no-op when ``path`` is None. A ``console`` is shown
    the records it prints a line for (with or without a file): the log and the
    console tell the same story. ``clock`` stamps the records (the simulator's is
    virtual); ``fresh``: a file already there is replaced, not appended to."""

    def __init__(self, path: str | Path | None, *, flush_every: float = 0.5,
                 console: Sink | None = None, clock: Callable[[], float] = time.time,
                 fresh: bool = False) -> None:
        self.path = Path(path) if path else None
        self.console = console
        self._clock = clock
        self._fh: IO[bytes] | None = None
        self._flush_every = flush_every
        self._last_flush = 0.0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("wb" if fresh else "ab")
            if not fresh and _ends_torn(self.path):
                # a killed predecessor (a restarted worker's) left half a record: end
                # that line, or our first record would be glued to it and lost
                self._fh.write(b"\n")

    def write(self, record: Event, t: float | None = None) -> None:
        """Write ``record``, stamped ``t`` (default: now)."""
        if not isinstance(record, Event):
            raise TypeError(f"an event log writes records of paramserver.observe.records, "
                            f"not {type(record).__name__}")
        console = self.console
        if console is not None and kind_of(record) not in console.events:
            console = None  # (a push's record, on the hot path: not a console line)
        if self._fh is None and console is None:
            return
        now = self._clock() if t is None else t
        if self._fh is not None:
            self._fh.write(encode(record, now))
            if now - self._last_flush >= self._flush_every:
                self._fh.flush()
                self._last_flush = now
        if console is not None:
            try:
                console.show(kind_of(record), fields_of(record), now)
            except Exception:  # a console must not take the process down
                log.exception("console line for %r failed", kind_of(record))

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

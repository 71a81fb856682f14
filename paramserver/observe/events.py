"""JSONL event logs: one JSON object per line, one file per process.

Every line has ``t`` (wall-clock seconds since the epoch), ``event`` (its kind)
and the fields of that kind: one of the records of
:mod:`paramserver.observe.records`, which docs/events.md describes.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, get_args, get_origin

import msgspec

from paramserver.observe.records import LOGS, Event, kind_of

if TYPE_CHECKING:
    from paramserver.observe.console import Sink

__all__ = ["EventLog", "encode", "fields_of", "read_events", "write_json"]

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode
# msgspec and json.dumps (with which the logs have always been written) print the
# same JSON but for a float outside [1e-4, 1e16) (1e-05, 1e+16; NaN, which msgspec
# writes as null), written here as json.dumps prints it, and a character json.dumps
# escapes (non-ASCII, DEL). A record with such a string, or with a map or list of
# floats (config, metrics: not looked into), is written by json.dumps: a log's
# bytes do not depend on the path a record takes.
_FIXED_LOW, _FIXED_HIGH = 1e-4, 1e16


class _Shape:
    """What the writer needs of a record type, worked out once."""

    def __init__(self, cls: type[Event]) -> None:
        if not any(cls in group for group in LOGS.values()):
            raise TypeError(f"{cls.__name__} is no record of paramserver.observe.records' LOGS")
        fields = [f for f in msgspec.structs.fields(cls) if f.name != cls.flat]
        last = msgspec.structs.fields(cls)[-1].name
        self.flat = cls.flat
        self.floats = tuple(f.name for f in fields if float in (f.type, *get_args(f.type)))
        # a map or list of floats (config, metrics), or a flat map written in the middle
        self.open = (self.flat is not None and self.flat != last) or any(
            _holds_floats(a) for f in fields for a in (f.type, *get_args(f.type)))


def _holds_floats(tp: Any) -> bool:
    """Whether a field of type ``tp`` may hold floats inside (a map, a list)."""
    if tp is Any or tp is dict or tp is list:
        return True
    return get_origin(tp) in (dict, list, tuple) and any(
        a is float or a is Any or _holds_floats(a) for a in get_args(tp))


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


def _odd(value: Any) -> bool:
    """A float that msgspec prints otherwise than json.dumps."""
    return isinstance(value, float) and not (
        _FIXED_LOW <= abs(value) < _FIXED_HIGH or value == 0.0)


def _float(value: float) -> msgspec.Raw:
    """A float as json.dumps prints it (1e-05, 1e+16, NaN, Infinity)."""
    return msgspec.Raw(json.dumps(value).encode())


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
    if shape.open:
        return _exact(record, t)
    odd = {name: _float(value) for name in shape.floats
           if _odd(value := getattr(record, name))}
    shown = msgspec.structs.replace(record, **odd) if odd else record
    if shape.flat is None:
        body = _encode(shown)
    else:  # the flat map's items in place of the record's last field
        figures = getattr(record, shape.flat)
        if any(_odd(v) for v in figures.values()):
            figures = {k: _float(v) if _odd(v) else v for k, v in figures.items()}
        body = _encode(msgspec.structs.replace(shown, **{shape.flat: {}}))
        body = body[:-len(shape.flat) - 7] + (b"," + _encode(figures)[1:] if figures else b"}")
    if not body.isascii() or b"\x7f" in body:
        return _exact(record, t)
    return b'{"t":' + repr(t).encode() + b"," + body[1:] + b"\n"


class EventLog:
    """Append-only JSONL writer; a no-op when ``path`` is None. A ``console`` is shown
    the records it prints a line for (with or without a file): the log and the
    console tell the same story. ``clock`` stamps the records (the simulator's is
    virtual); ``fresh``: a file already there is replaced, not appended to."""

    def __init__(self, path: str | Path | None, *, flush_every: float = 0.5,
                 console: Sink | None = None, clock: Callable[[], float] = time.time,
                 fresh: bool = False, lazy: bool = False) -> None:
        self.path = Path(path) if path else None
        self.console = console
        self._clock = clock
        self._fh: IO[bytes] | None = None
        self._flush_every = flush_every
        self._last_flush = 0.0
        self._fresh = fresh
        # lazy: the file is opened by the first record, not here (a shard is built
        # without I/O and opens what it serves through when started)
        self._pending = self.path is not None and lazy
        if self.path is not None and not lazy:
            self._open(self.path)

    def _open(self, path: Path) -> None:
        self._pending = False
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = path.open("wb" if self._fresh else "ab")
        if not self._fresh and _ends_torn(path):
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
        if self._pending and self.path is not None:
            self._open(self.path)
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
        self._pending = False  # (what comes after the close is dropped, as before)
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
    """All records of a JSONL log (optionally only one kind); a torn last line, or any
    line that is not a JSON object (a damaged file), is skipped."""
    out = []
    with Path(path).open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(rec, dict):
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

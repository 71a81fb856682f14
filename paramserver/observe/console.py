"""A shard's console: the event records that tell a run's story, one line each.

:class:`EventLog` hands every record it writes to its console, so what a person
reads is what the log holds (docs/events.md); records no one reads as they
happen (a push, a metrics snapshot) print nothing. The lines go to a writer: a
plain stderr writer for a foreground ``paramserver server``, the shard's logger
for a shard the launcher started (its log file).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import IO, Any, Protocol

__all__ = ["CONSOLE_EVENTS", "Console", "Progress", "Sink", "render"]

log = logging.getLogger(__name__)


class Sink(Protocol):
    """What an :class:`~paramserver.observe.events.EventLog` shows its records to."""

    @property
    def events(self) -> frozenset[str]:
        """The record kinds it wants (the others are not handed to it)."""

    def show(self, event: str, fields: Mapping[str, Any], t: float) -> None:
        """The record ``event`` with ``fields``, written at ``t`` (epoch seconds)."""


def _ids(workers: list[int]) -> str:
    return ", ".join(map(str, workers))


def _start(f: Mapping[str, Any]) -> str:
    cfg = f.get("config") or {}
    num = cfg.get("num_shards", "?")
    metrics = (f" Metrics on port {f['metrics_port']}." if f.get("metrics_port") is not None
               else "")
    return (f"shard {f['shard']} of {num} listening on {f['address']} ({f.get('mode', '?')}, "
            f"policy {f.get('policy', '?')}, optimizer {cfg.get('optimizer', '?')}); waiting "
            f"for {f.get('expected_workers', '?')} worker(s).{metrics}")


def _training(f: Mapping[str, Any]) -> str:
    workers = f["workers"]
    return (f"training started: {len(workers)} worker(s) ({_ids(workers)}), {f['mode']}, "
            f"at version {f['version']}")


def _hello(f: Mapping[str, Any]) -> str | None:
    joined, worker, clock = f.get("joined"), f["worker"], f["clock"]
    where = f" (pid {f['pid']} on {f['host']})" if f.get("host") else ""
    if joined == "new":
        return f"worker {worker} joined at clock {clock}{where}"
    if joined == "resumed":  # a resumed run's worker, back: never dead, not restarted
        return f"worker {worker} resumed at clock {clock}{where}"
    if joined in ("restart", "back"):
        how = "restarted" if joined == "restart" else "came back"
        return f"worker {worker} {how}: {_resumes(f['from_clock'], clock)}{where}"
    return None  # the same process's second HELLO (shared memory): nothing new


def _resumes(was: int, clock: int) -> str:
    """Where a returning worker goes on, and why when it is not where it left off."""
    if clock == was:
        return f"rejoined at clock {clock}"
    return f"rejoined at clock {was} -> resumes at {clock}, the slowest live worker's clock"


def _back(f: Mapping[str, Any]) -> str:
    return (f"worker {f['worker']} heartbeats again after it was declared dead: "
            f"{_resumes(f['from_clock'], f['clock'])}")


def _dead(f: Mapping[str, Any]) -> str:
    at = f" at clock {f['clock']}" if f.get("clock") is not None else ""
    if f.get("reported"):
        return f"worker {f['worker']} dead{at}: its supervisor saw the process die"
    timeout = f" for {f['timeout']:g}s" if f.get("timeout") is not None else ""
    return f"worker {f['worker']} dead{at}: no heartbeat{timeout}"


def _left_out(f: Mapping[str, Any]) -> str:
    return (f"worker {f['worker']} left out: it pushed nothing for the round deadline "
            f"({f['deadline']:g}s); the others go on without it until it pushes again")


def _bye(f: Mapping[str, Any]) -> str:
    at = f" at clock {f['clock']}" if f.get("clock") is not None else ""
    return f"worker {f['worker']} finished{at}"


def _done(f: Mapping[str, Any]) -> str:
    finished, dead = f["finished"], f["dead"]
    took = f"at version {f['version']} after {f['seconds']:.1f}s of training"
    if not dead:
        return f"all {len(finished)} worker(s) done {took}"
    return (f"no live worker left {took}: finished {_ids(finished) or 'none'}; dead "
            f"{_ids(dead)} (a restarted one rejoins)")


def _checkpoint(f: Mapping[str, Any]) -> str:
    return f"checkpoint written at version {f['version']}: {f['path']}"


def _refused(f: Mapping[str, Any]) -> str:
    return (f"checkpoint at version {f['version']} NOT written (the last good one stays): "
            f"{f['error']}")


def _diverged(f: Mapping[str, Any]) -> str:
    saved = f"; checkpoint {f['checkpoint']}" if f.get("checkpoint") else ""
    return f"training stopped ({f['action']}) at version {f['version']}: {f['message']}{saved}"


def _stop(f: Mapping[str, Any]) -> str:
    return f"shard {f['shard']} stopped at version {f['version']}"


#: event -> its line (None: nothing to say about this record)
_RENDER: dict[str, Callable[[Mapping[str, Any]], str | None]] = {
    "server_start": _start,
    "training_start": _training,
    "worker_hello": _hello,
    "worker_back": _back,
    "worker_dead": _dead,
    "worker_left_out": _left_out,
    "worker_bye": _bye,
    "all_done": _done,
    "checkpoint": _checkpoint,
    "checkpoint_refused": _refused,
    "diverged": _diverged,
    "server_stop": _stop,
}

#: the events a console prints a line for
CONSOLE_EVENTS = frozenset(_RENDER)


def render(event: str, fields: Mapping[str, Any]) -> str | None:
    """The console line of one event record, or None for records it does not show."""
    fn = _RENDER.get(event)
    if fn is None:
        return None
    try:
        return fn(fields)
    except (KeyError, TypeError, ValueError) as exc:  # a record from an older writer
        log.debug("cannot render %s: %s", event, exc)
        return None


class Console:
    """Prints the lines of :data:`CONSOLE_EVENTS`' records through ``write``."""

    events = CONSOLE_EVENTS

    def __init__(self, write: Callable[[str], None], *, stamp: bool = False) -> None:
        self._write = write
        self._stamp = stamp  # each line after the record's time of day

    def show(self, event: str, fields: Mapping[str, Any], t: float) -> None:
        """Print the line of the record ``event`` written at ``t`` with ``fields``."""
        line = render(event, fields)
        if line is not None:
            self._write(f"{datetime.fromtimestamp(t):%H:%M:%S} {line}" if self._stamp else line)

    @classmethod
    def to_stream(cls, stream: IO[str] | None = None, prefix: str = "paramserver: ") -> Console:
        """Lines on ``stream`` (stderr by default), each after the time of day."""

        def write(line: str) -> None:
            out = stream if stream is not None else sys.stderr
            out.write(f"{prefix}{line}\n")
            out.flush()

        return cls(write, stamp=True)

    @classmethod
    def to_log(cls, logger: logging.Logger | None = None) -> Console:
        """Lines as INFO records (a launched shard's log file has the time and shard)."""
        return cls((logger or log).info)


class Progress:
    """A worker's progress from its ``step`` records: on a terminal one live line,
    rewritten at most every ``tty_every`` seconds and ended by ``worker_end``; elsewhere
    (a log file, a pipe) one line every ``every`` seconds."""

    events = frozenset({"step", "worker_end"})

    def __init__(self, stream: IO[str] | None = None, *, every: float = 5.0,
                 tty_every: float = 0.5) -> None:
        self._stream = stream
        out = self.out
        self.live = bool(getattr(out, "isatty", lambda: False)())
        self.every = tty_every if self.live else every
        self._last: tuple[float, int] | None = None  # (t, steps) of the last line
        self._steps = 0
        self._drawn = False  # a live line is on the screen

    @property
    def out(self) -> IO[str]:
        return self._stream if self._stream is not None else sys.stderr

    def show(self, event: str, fields: Mapping[str, Any], t: float) -> None:
        if event == "worker_end":
            if self._drawn:
                self.out.write("\n")
                self.out.flush()
                self._drawn = False
            return
        self._steps += 1
        if self._last is None:  # the rate counts from the first step on
            self._last = (t, self._steps)
            return
        since, steps = self._last
        if t - since < self.every:
            return
        self._last = (t, self._steps)
        rate = (self._steps - steps) / (t - since)
        loss = fields.get("loss")
        line = (f"worker {fields['worker']}: step {self._steps} (clock {fields['clock']}), "
                f"loss {loss:.4g}, {rate:.1f} steps/s" if isinstance(loss, float) else
                f"worker {fields['worker']}: step {self._steps} (clock {fields['clock']}), "
                f"{rate:.1f} steps/s")
        if self.live:
            self.out.write(f"\r\x1b[K{line}")
            self._drawn = True
        else:
            self.out.write(f"paramserver: {datetime.fromtimestamp(t):%H:%M:%S} {line}\n")
        self.out.flush()

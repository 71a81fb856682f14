"""The trace of a run: what happened at every push, compact, versioned and bounded.

``--trace`` (``launch``, ``run``, ``experiment``) gives each shard and each worker a
file under ``trace/`` in the run directory: ``shard<k>.pstrace`` and
``worker<r>.pstrace``. A shard's file holds, in the order the shard saw them, the
pushes that arrived (:class:`Arrival`: worker, push id, clock, the version read, the
version after, the policy's decision and weight, the bytes) and the pulls it answered
(:class:`Served`: which worker read which version, and when), and in sync mode each
round's members (:class:`Round`). A worker's file holds its steps (:class:`WorkerStep`:
the versions it read, compute, sleep, pull and push seconds, bytes). The two sides are
merged at read time (:func:`read_trace_dir`); ``paramserver simulate --replay`` re-runs
the schedule they describe (paramserver/workers/launch/replay.py).

Format (version :data:`FORMAT`): a file is a sequence of frames, each a 4-byte
little-endian length and one msgpack array (msgspec, ``array_like``) whose first item
names the record. The first frame is a :class:`Header` (the format version, who wrote
it, its whole configuration); the last is :class:`End` when the process closed it, or
:class:`Capped` when it reached its cap. Bounded: a record is at most
:data:`MAX_RECORD` bytes (a file cut off by a killed process is read up to its last
whole record, and has no End); a push costs at most :data:`PUSH_BYTES` bytes at a shard
(one Arrival and one Served, 44 to 90 in practice) and :data:`STEP_BYTES` at a worker;
a file stops recording at ``cap`` bytes (:data:`DEFAULT_CAP`, 64 MiB: about 400,000
pushes per shard), writes :class:`Capped`, and says so in the log; a replay refuses a
capped trace. Never pickle: msgspec only.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from paramserver.errors import ConfigError

__all__ = ["DEFAULT_CAP", "FORMAT", "MAX_RECORD", "PUSH_BYTES", "STEP_BYTES", "Arrival",
           "Capped", "End", "Header", "Left", "Round", "Served", "ShardTrace", "StepSink",
           "Trace", "TraceWriter", "WorkerStep", "WorkerTrace", "read_trace",
           "read_trace_dir", "shard_file", "worker_file"]

log = logging.getLogger(__name__)

#: the format's version: a reader refuses another
FORMAT = 1
#: the largest record a reader accepts (a header carries a configuration)
MAX_RECORD = 1 << 20
#: the most bytes one push adds to a shard's file (Arrival + Served, with frames)
PUSH_BYTES = 160
#: the most bytes one step adds to a worker's file (WorkerStep with one version per
#: shard, 9 bytes each at most, added on top)
STEP_BYTES = 96
#: a file's cap, bytes
DEFAULT_CAP = 64 << 20
#: bounds a header is checked against: torch's intra-op threads (ServerConfig.threads'
#: bound), and a shard index or worker rank
MAX_THREADS = 1024
MAX_PROCESSES = 1 << 16
_LEN = struct.Struct("<I")


class _Rec(msgspec.Struct, array_like=True, tag_field="k", omit_defaults=False):
    """A trace record: a msgpack array, its first item the record's tag."""


class Header(_Rec, tag="h"):
    format: int
    role: str  # "shard" | "worker"
    index: int  # the shard or the worker rank
    config: dict[str, Any]  # ServerConfig.to_dict() / WorkerConfig.to_dict()
    threads: int  # torch intra-op threads of the process
    cap: int


class Arrival(_Rec, tag="a"):
    """A push the shard decided on (a retried one is not recorded again)."""

    t: float  # the shard's monotonic clock, seconds (the core's ``now``)
    worker: int
    push_id: int
    clock: int
    read_version: int
    num_samples: int
    version: int  # the shard's version after it
    staleness: int
    accepted: bool
    weight: float
    reason: str
    nbytes: int  # on the wire
    parts: int


class Served(_Rec, tag="s"):
    """A pull the shard answered: the worker read ``version`` here."""

    t: float
    worker: int
    clock: int
    version: int


class Round(_Rec, tag="r"):
    """Sync: the round that made ``version`` and the workers whose pushes it holds."""

    version: int
    members: list[int]


class Left(_Rec, tag="l"):
    """A worker said BYE to the shard."""

    t: float
    worker: int


class WorkerStep(_Rec, tag="w"):
    """One push of a worker, as it saw it."""

    clock: int
    read_versions: list[int]
    accepted: bool
    weight: float
    loss: float | None
    num_samples: int
    compute_s: float
    sleep_s: float
    pull_s: float
    push_s: float  # push and its reply: the wire time
    bytes: int


class Capped(_Rec, tag="c"):
    """The cap was reached: nothing after this was recorded."""

    records: int
    nbytes: int


class End(_Rec, tag="e"):
    """The process closed its trace: the file is whole."""

    records: int


Record = Header | Arrival | Served | Round | Left | WorkerStep | Capped | End
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Record)


def shard_file(directory: str | Path, shard: int) -> Path:
    return Path(directory) / f"shard{shard}.pstrace"


def worker_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"worker{rank}.pstrace"


class TraceWriter:
    """Appends records to one trace file, up to ``cap`` bytes (then :class:`Capped`)."""

    def __init__(self, path: str | Path, header: Header) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.cap = header.cap
        self.records = 0
        self.nbytes = 0
        self.capped = False
        self._fh: BinaryIO | None = open(self.path, "wb")  # noqa: SIM115 (closed by close)
        self._frame(header)

    def _frame(self, record: _Rec) -> int:
        data = _ENCODER.encode(record)
        assert self._fh is not None
        self._fh.write(_LEN.pack(len(data)))
        self._fh.write(data)
        return _LEN.size + len(data)

    def write(self, record: _Rec) -> bool:
        """Record ``record``; False (and nothing written) once the cap is reached."""
        if self._fh is None or self.capped:
            return False
        data = _ENCODER.encode(record)
        # room is kept for the Capped record itself
        if self.nbytes + _LEN.size + len(data) + 32 > self.cap:
            self.capped = True
            self._frame(Capped(self.records, self.nbytes))
            self._fh.flush()
            log.warning("trace %s reached its cap of %d bytes after %d records: recording "
                        "stopped (a capped trace cannot be replayed)", self.path, self.cap,
                        self.records)
            return False
        self._fh.write(_LEN.pack(len(data)))
        self._fh.write(data)
        self.nbytes += _LEN.size + len(data)
        self.records += 1
        return True

    def close(self) -> None:
        if self._fh is None:
            return
        if not self.capped:
            self._frame(End(self.records))
        self._fh.close()
        self._fh = None


def _frames(data: bytes, path: Path) -> Iterator[Record]:
    at = 0
    while at < len(data):
        n = _LEN.unpack_from(data, at)[0] if at + _LEN.size <= len(data) else 0
        if n > MAX_RECORD:
            raise ConfigError(f"trace {path}: a record of {n} bytes at byte {at} "
                              f"(at most {MAX_RECORD}): not a trace, or damaged")
        if at + _LEN.size + n > len(data) or n == 0:
            # a process killed mid-write: what came before is whole (the file has no End)
            log.warning("trace %s is cut off at byte %d (its process did not close it): "
                        "read up to there", path, at)
            return
        at += _LEN.size
        try:
            yield _DECODER.decode(data[at:at + n])
        except msgspec.DecodeError as exc:
            raise ConfigError(f"trace {path}: bad record at byte {at}: {exc}") from exc
        at += n


def read_trace(path: str | Path) -> tuple[Header, list[Record]]:
    """A trace file's header and records (its End or Capped last)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc.strerror}") from exc
    frames = _frames(data, path)
    header = next(frames, None)
    if not isinstance(header, Header):
        raise ConfigError(f"trace {path}: no header; not a trace file")
    if header.format != FORMAT:
        raise ConfigError(f"trace {path} has format {header.format}; this paramserver reads "
                          f"format {FORMAT}")
    # what a replay acts on before any config is checked: a thread count torch would
    # take (a huge one crashes it), the role and index that name the file's process
    if header.role not in ("shard", "worker") or not 0 <= header.index < MAX_PROCESSES \
            or not 0 <= header.threads <= MAX_THREADS or header.cap < 0:
        raise ConfigError(f"trace {path}: a damaged header (role {header.role!r}, index "
                          f"{header.index}, threads {header.threads}, cap {header.cap})")
    return header, list(frames)


@dataclass
class ShardTrace:
    header: Header
    events: list[Arrival | Served | Round | Left]
    whole: bool  # an End record closed it
    capped: bool


@dataclass
class WorkerTrace:
    header: Header
    steps: list[WorkerStep]
    whole: bool
    capped: bool


@dataclass
class Trace:
    """A run's trace: every shard's and worker's file, merged."""

    directory: Path
    shards: dict[int, ShardTrace] = field(default_factory=dict)
    workers: dict[int, WorkerTrace] = field(default_factory=dict)

    @property
    def server_config(self) -> Mapping[str, Any]:
        return self.shards[0].header.config

    def pushes(self) -> int:
        return sum(isinstance(e, Arrival) for e in self.shards[0].events) if self.shards else 0


def _split(path: Path) -> tuple[Header, list[Record], bool, bool]:
    header, records = read_trace(path)
    whole = bool(records) and isinstance(records[-1], End)
    capped = any(isinstance(r, Capped) for r in records)
    return header, [r for r in records if not isinstance(r, (End, Capped, Header))], whole, capped


def read_trace_dir(directory: str | Path) -> Trace:
    """Every ``*.pstrace`` of a trace directory (a run directory's ``trace/``, or the run
    directory itself), merged: shards by index, workers by rank."""
    directory = Path(directory)
    if (directory / "trace").is_dir():
        directory = directory / "trace"
    trace = Trace(directory)
    for path in sorted(directory.glob("*.pstrace")):
        header, records, whole, capped = _split(path)
        if header.index in (trace.shards if header.role == "shard" else trace.workers):
            raise ConfigError(f"trace {path}: a second file of {header.role} "
                              f"{header.index} in {directory}")
        if header.role == "shard":
            trace.shards[header.index] = ShardTrace(
                header, [r for r in records if isinstance(r, (Arrival, Served, Round, Left))],
                whole, capped)
        else:
            trace.workers[header.index] = WorkerTrace(
                header, [r for r in records if isinstance(r, WorkerStep)], whole, capped)
    if not trace.shards:
        raise ConfigError(f"no shard trace (shard<k>.pstrace) in {directory}: was the run "
                          f"started with --trace?")
    if 0 not in trace.shards:  # (its header holds the run's server config)
        raise ConfigError(f"no trace of shard 0 in {directory} (shards "
                          f"{sorted(trace.shards)[:8]})")
    return trace


class StepSink:
    """A worker's event-log console that also records each ``step`` record in its trace
    (the worker's side: what it read, its compute and wire time), then hands the records
    the inner console wants to it."""

    def __init__(self, writer: TraceWriter, inner: Any | None) -> None:
        self.writer, self.inner = writer, inner
        wanted = frozenset(inner.events) if inner is not None else frozenset()
        self._inner_events = wanted
        self.events = wanted | {"step"}

    def show(self, event: str, fields: Mapping[str, Any], t: float) -> None:
        if event == "step":
            self.writer.write(WorkerStep(
                int(fields["clock"]), list(fields["read_versions"]), bool(fields["accepted"]),
                float(fields["weight"]), fields.get("loss"), int(fields["num_samples"]),
                float(fields["compute_s"]), float(fields["sleep_s"]), float(fields["pull_s"]),
                float(fields["push_s"]), int(fields["bytes"])))
        if self.inner is not None and event in self._inner_events:
            self.inner.show(event, fields, t)

"""A shard's STATS reply as one typed record, :class:`ShardStats`, and its bounds.

The server builds the record (its own figures, the core's
:class:`~paramserver.core.report.CoreStats`, the observer's
:class:`ObservedStats`, a sparse table's :class:`SparseStats`); :func:`fields`
writes it as the reply's map, with the keys and their order the map has always
had, so the bytes on the wire are unchanged; :func:`decode` (called once by
wire/messages.py for every STATS reply) reads it back, checked and bounded.
:func:`fit` trims a record's worker listing until it fits one header.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgpack
import msgspec
from msgspec.structs import replace

from paramserver.core.records import STATS_WORKERS
from paramserver.core.report import CoreStats, Count, WorkerStats
from paramserver.errors import ErrorCode, ProtocolError
from paramserver.sparse.shard import STATS_TABLES
from paramserver.util.jsontypes import JSONObject
from paramserver.wire.protocol import MAX_HEADER_BYTES, Message, Op

__all__ = [
    "ALARMS_LISTED", "STATS_BYTES", "AlarmEntry", "CoreStats", "Figure", "LastPush",
    "ObservedStats", "ShardStats", "SparseStats", "StepFigures", "TableStats", "Unplanned",
    "WorkerStats", "answer", "decode", "fields", "fit", "heard",
]

#: what a STATS reply's fields may take of a header (the decoder refuses one over
#: MAX_HEADER_BYTES); the rest is the envelope's
STATS_BYTES = MAX_HEADER_BYTES * 3 // 4

#: the latest alarms a STATS reply lists (alarm_count counts them all)
ALARMS_LISTED = 20

#: an alarm's figure: a number mostly, as its rule names it
Figure = float | int | str | bool | None


class StepFigures(msgspec.Struct, frozen=True, omit_defaults=True):
    """The last optimizer step's figures (all None, an empty map, before the first)."""

    update_norm: float | None = None
    weight_norm: float | None = None
    update_ratio: float | None = None
    lr: float | None = None


class LastPush(msgspec.Struct, frozen=True, omit_defaults=True):
    """A worker's last push as the shard's observer saw it; a figure never measured
    is None (and left off the wire)."""

    staleness: int
    grad_norm: float | None = None
    cosine: float | None = None
    loss: float | None = None


class AlarmEntry(msgspec.Struct, frozen=True):
    """One alarm as STATS lists it and the event logs write it (``alarm`` events)."""

    signal: str
    shard: int | None
    worker: int | None
    version: int | None
    figures: dict[str, Figure]
    message: str

    @classmethod
    def of(cls, event: Mapping[str, Any]) -> AlarmEntry:
        """The alarm of an ``alarm`` event (a shard's event log, or the launcher's
        callback); its other keys (``t``, ``process``...) are left out."""
        return msgspec.convert(event, cls)


class ObservedStats(msgspec.Struct, frozen=True):
    """The shard's observer: the last step, each listed worker's last push, alarms."""

    step: StepFigures = StepFigures()
    #: the workers the reply lists (fit() leaves out the others')
    workers: Annotated[dict[str, LastPush], msgspec.Meta(max_length=STATS_WORKERS)] = {}
    alarms: Annotated[list[AlarmEntry], msgspec.Meta(max_length=ALARMS_LISTED)] = []
    alarm_count: Count = 0


class TableStats(msgspec.Struct, frozen=True):
    rows: Count
    initialized: bool


class SparseStats(msgspec.Struct, frozen=True):
    """A shard's row-sparse tables (paramserver/sparse/shard.py), the first
    STATS_TABLES of them listed."""

    version: Count
    rounds: Count
    built: bool
    tables: Annotated[dict[str, TableStats], msgspec.Meta(max_length=STATS_TABLES)]
    tables_count: Count

    @classmethod
    def of(cls, report: Mapping[str, Any]) -> SparseStats:
        """The record of SparseShard.stats()'s map."""
        return msgspec.convert(report, cls)


class Unplanned(msgspec.Struct, frozen=True):
    """A shard that has no plan yet (no worker said HELLO with one): its configured
    mode and policy, and nothing else of a core."""

    mode: str
    policy: str


class ShardStats(msgspec.Struct, frozen=True):
    """One shard's STATS reply: the server's figures, its core's, its observer's."""

    shard: Count
    num_shards: Count
    address: str
    uptime: float
    counters: dict[str, int]  # the server's event counts, by name (error_<code>, ...)
    metrics_port: int | None
    measured_one_in: Count  # pushes measured in full: one in N per worker (1: all)
    observed: ObservedStats
    core: CoreStats | Unplanned
    sparse: SparseStats | None = None

    # what every shard reports, planned or not
    @property
    def mode(self) -> str:
        return self.core.mode

    @property
    def policy(self) -> str:
        return self.core.policy

    @property
    def version(self) -> int:
        return self.core.version if isinstance(self.core, CoreStats) else 0

    @property
    def initialized(self) -> bool:
        return isinstance(self.core, CoreStats) and self.core.initialized

    @property
    def workers(self) -> dict[str, WorkerStats]:
        return self.core.workers if isinstance(self.core, CoreStats) else {}

    @property
    def figures(self) -> CoreStats | None:
        """The core's figures (None: no plan yet)."""
        return self.core if isinstance(self.core, CoreStats) else None

    def to_dict(self) -> JSONObject:
        """The reply's map as the wire carried it (``re`` first), JSON-able: what
        ``paramserver status --json`` prints and result.json keeps."""
        return {"re": "stats", **fields(self)}


_SERVER = ("shard", "num_shards", "address", "uptime", "counters", "metrics_port",
           "measured_one_in", "observed")


def fields(stats: ShardStats) -> JSONObject:
    """The STATS reply's map of ``stats``: the server's figures, then the core's (or an
    unplanned shard's few), then the sparse tables', in the order they always had."""
    out: JSONObject = {k: msgspec.to_builtins(getattr(stats, k)) for k in _SERVER}
    if isinstance(stats.core, CoreStats):
        out.update(msgspec.to_builtins(stats.core))  # ("shard" keeps its place, first)
    else:
        out.update(mode=stats.core.mode, version=0, workers={}, initialized=False,
                   policy=stats.core.policy)
    if stats.sparse is not None:
        out["sparse"] = msgspec.to_builtins(stats.sparse)
    return out


class _Head(msgspec.Struct, frozen=True):
    """The server's part of a STATS reply's fields (the core's lie beside it)."""

    shard: Count
    num_shards: Count
    address: str
    uptime: float
    counters: dict[str, int]
    metrics_port: int | None
    measured_one_in: Count
    observed: ObservedStats
    sparse: SparseStats | None = None


def heard(core: CoreStats, peers: Mapping[int, Mapping[str, Any]]) -> CoreStats:
    """``core``'s figures with each listed worker's host and pid as its HELLO named
    them (``peers``: the server's, by worker id)."""
    return replace(core, workers={
        key: w if (peer := peers.get(int(key))) is None
        else replace(w, host=peer.get("host"), pid=peer.get("pid"))
        for key, w in core.workers.items()})


def answer(request: Message, stats: ShardStats) -> Message:
    """The REPLY to a STATS ``request``: ``re``, then the fields of ``stats``."""
    return Message(Op.REPLY, request.seq, {"re": request.op.value, **fields(stats)})


def decode(f: Mapping[str, Any]) -> ShardStats:
    """The record of a STATS reply's fields, their types and bounds checked (a shard
    with a plan reports ``started``). Raises ProtocolError."""
    try:
        head = msgspec.convert(f, _Head)
        core: CoreStats | Unplanned = (msgspec.convert(f, CoreStats) if "started" in f
                                       else msgspec.convert(f, Unplanned))
    except msgspec.ValidationError as exc:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"stats reply: {exc}") from exc
    return ShardStats(head.shard, head.num_shards, head.address, head.uptime, head.counters,
                      head.metrics_port, head.measured_one_in, head.observed, core,
                      head.sparse)


def fit(stats: ShardStats, limit: int = STATS_BYTES) -> ShardStats:
    """``stats`` (a shard's full STATS) with fewer workers listed, the last ones first,
    until it encodes in ``limit`` bytes: every map in it is bounded (STATS_WORKERS
    workers, bucketed staleness, MAX_REASONS reasons), but not so far that 512 full
    summaries always fit a header; the figures that count every worker stay."""
    core = stats.core
    workers = core.workers if isinstance(core, CoreStats) else {}
    while True:
        # the observer's figures for the listed workers only (its table is the core's,
        # up to --max-workers entries)
        observed = stats.observed
        stats = replace(stats, observed=replace(observed, workers={
            k: v for k, v in observed.workers.items() if k in workers}))
        if not isinstance(core, CoreStats) or not workers or len(
                msgpack.packb(fields(stats), use_bin_type=True)) <= limit:
            return stats
        workers = dict(list(workers.items())[:len(workers) // 2])
        core = replace(core, workers=workers, workers_listed=len(workers))
        stats = replace(stats, core=core)

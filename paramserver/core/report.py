"""What a shard core reports of itself: :func:`stats`, the core's part of the STATS
op's answer, as a :class:`CoreStats` record with a :class:`WorkerStats` per worker.

It reads a :class:`~paramserver.core.shard.ShardCore` and decides nothing; the
figures it reports (clocks, the SSP bound, rounds, each worker's counters)
are kept by the core and its records. The records' fields are in the order the
STATS map has always had on the wire (wire/stats.py encodes them in that order),
and their bounds are what a reader may rely on once the wire decoded them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated

import msgspec

from paramserver.core.probe import l2
from paramserver.core.records import MAX_REASONS, STATS_WORKERS, WorkerState
from paramserver.util.jsontypes import JSONObject

if TYPE_CHECKING:  # core imports this module to report itself
    from paramserver.core.corestate import CoreState

__all__ = ["CoreStats", "WorkerStats", "stats", "worker_stats"]

Count = Annotated[int, msgspec.Meta(ge=0)]


class WorkerStats(msgspec.Struct, frozen=True, omit_defaults=True):
    """One worker as a shard's STATS lists it: its clock, state and counters.

    ``host`` and ``pid`` are what the worker said in its HELLO (the server adds
    them; None, and left off the wire, for a worker it has not heard say HELLO)."""

    worker: Count
    clock: Count
    live: bool
    finished: bool
    pushes: Count
    applied: Count
    #: rejected pushes by reason, at most MAX_REASONS of them and one for the others
    rejected: Annotated[dict[str, Count], msgspec.Meta(max_length=MAX_REASONS + 1)]
    downweighted: Count
    mean_weight: float
    staleness: dict[str, Count]  # {tau: count}, tau bucketed (records.staleness_bucket)
    staleness_max: Count
    staleness_sum: Count
    pulls: Count
    deferred_pulls: Count
    wait_seconds: float
    deaths: Count
    host: str | None = None
    pid: int | None = None


def worker_stats(w: WorkerState) -> WorkerStats:
    """``w``'s row of the STATS answer (no host and pid: the core does not know them)."""
    return WorkerStats(
        w.worker, w.clock, w.live, w.finished, w.pushes, w.applied, dict(w.rejected),
        w.downweighted, w.weight_sum / w.applied if w.applied else 0.0,
        {str(k): v for k, v in sorted(w.staleness.items())}, w.staleness_max,
        w.staleness_sum, w.pulls, w.deferred_pulls, w.wait_seconds, w.deaths)


class CoreStats(msgspec.Struct, frozen=True):
    """A shard core's state, bounded whatever its worker table holds."""

    shard: Count
    mode: str  # as ModeSpec.describe() writes it: "sync", "ssp(s=3)"...
    policy: str
    version: Count
    initialized: bool
    started: bool
    lr: float
    lr_scaling: str
    lr_factor: float
    # (None: no momentum target set)
    momentum_target: float | None
    momentum_explicit: float | None
    momentum_implicit: float | None
    mean_staleness_estimate: float | None
    live_workers: Annotated[list[int], msgspec.Meta(max_length=STATS_WORKERS)]
    live_count: Count
    min_clock: Count
    clock_gap: Count
    max_answered_gap: Count
    staleness_bound: int | None  # (None: not SSP)
    staleness_bound_max: int | None
    pending_pulls: Count
    rounds_dropped: Count
    steps_refused: Count  # undone: they made something NaN or Inf
    rounds_voided: Count
    rounds_in_place: Count
    rounds_ahead: Count
    ahead_found_busy: Count
    weight_norm: float
    #: by worker id (a string: msgpack map keys); live workers first, then the most
    #: recently seen, at most STATS_WORKERS (a map over 4096 entries would not decode)
    workers: Annotated[dict[str, WorkerStats], msgspec.Meta(max_length=STATS_WORKERS)]
    workers_known: Count
    workers_listed: Count
    workers_evicted: Count

    def to_dict(self) -> JSONObject:
        """As the STATS map lists these figures, JSON-able (a simulated run's result.json)."""
        out: JSONObject = msgspec.to_builtins(self)
        return out


def stats(core: CoreState) -> CoreStats:
    """``core``'s state, bounded whatever its worker table holds."""
    live = core.live()
    momentum = core.stepper.momentum
    listed = list(core.workers.values())
    if len(listed) > STATS_WORKERS:
        listed = sorted(listed,
                        key=lambda w: (not (w.live and not w.finished), -w.last_seen)
                        )[:STATS_WORKERS]
    ssp = core.mode.mode == "ssp"
    return CoreStats(
        shard=core.config.shard,
        mode=core.mode.describe(),
        policy=core.policy.describe(),
        version=core.version,
        initialized=core.initialized,
        started=core.started,
        lr=core.lr,
        lr_scaling=core.stepper.lr_rule.describe(),
        lr_factor=core.stepper.lr_factor,
        momentum_target=momentum.target if momentum is not None else None,
        momentum_explicit=momentum.explicit if momentum is not None else None,
        momentum_implicit=momentum.implicit if momentum is not None else None,
        mean_staleness_estimate=momentum.mean_staleness if momentum is not None else None,
        live_workers=sorted(w.worker for w in live)[:STATS_WORKERS],
        live_count=len(live),
        min_clock=core.min_clock(),
        clock_gap=core.clock_gap(),
        max_answered_gap=core.max_answered_gap,
        staleness_bound=core.bound if ssp else None,
        staleness_bound_max=core.max_bound if ssp else None,
        pending_pulls=core.pending_pulls(),
        rounds_dropped=core.rounds_dropped,
        steps_refused=core.stepper.refused,
        rounds_voided=core.rounds_voided,
        rounds_in_place=core.round.in_place,
        rounds_ahead=core.ahead.committed,
        ahead_found_busy=core.ahead.found_busy,
        # in the weights' own dtype: a float64 copy of each slice would be a peak
        weight_norm=math.sqrt(sum(l2(p.detach()) ** 2 for p in core.params.values())),
        workers={str(w.worker): worker_stats(w) for w in listed},
        workers_known=len(core.workers),
        workers_listed=len(listed),
        workers_evicted=core.workers_evicted,
    )

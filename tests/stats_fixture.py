"""STATS records for the views' tests: every field given, the ones a test cares
about named (paramserver/wire/stats.py)."""

from __future__ import annotations

from typing import Any

from msgspec.structs import replace

from paramserver.wire.stats import CoreStats, ObservedStats, ShardStats, WorkerStats


def worker_stats(worker: int, **over: Any) -> WorkerStats:
    row = WorkerStats(worker, clock=0, live=True, finished=False, pushes=0, applied=0,
                      rejected={}, downweighted=0, mean_weight=0.0, staleness={},
                      staleness_max=0, staleness_sum=0, pulls=0, deferred_pulls=0,
                      wait_seconds=0.0, deaths=0)
    return replace(row, **over)


def core_stats(shard: int, workers: dict[str, WorkerStats], **over: Any) -> CoreStats:
    core = CoreStats(
        shard, mode="async", policy="none", version=0, initialized=True, started=True,
        lr=0.1, lr_scaling="none", lr_factor=1.0, momentum_target=None,
        momentum_explicit=None, momentum_implicit=None, mean_staleness_estimate=None,
        live_workers=sorted(int(k) for k, w in workers.items() if w.live),
        live_count=sum(w.live for w in workers.values()), min_clock=0, clock_gap=0,
        max_answered_gap=0, staleness_bound=None, staleness_bound_max=None, pending_pulls=0,
        rounds_dropped=0, steps_refused=0, rounds_voided=0, rounds_in_place=0,
        rounds_ahead=0, ahead_found_busy=0, weight_norm=1.0, workers=workers,
        workers_known=len(workers), workers_listed=len(workers), workers_evicted=0)
    return replace(core, **over)


def shard_stats(shard: int, workers: dict[str, WorkerStats], *,
                observed: ObservedStats | None = None, measured_one_in: int = 1,
                **core: Any) -> ShardStats:
    """Shard ``shard`` of 3, at a made-up address, with these workers and core figures."""
    return ShardStats(shard, 3, f"tcp://127.0.0.1:{5600 + shard}", 1.0, {}, None,
                      measured_one_in, observed or ObservedStats(),
                      core_stats(shard, workers, **core))

"""What a shard core reports of itself: :func:`stats`, the STATS op's answer.

It reads a :class:`~paramserver.core.shard.ShardCore` and decides nothing; the
figures it reports (clocks, the SSP bound, rounds, each worker's counters)
are kept by the core and its records.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from paramserver.core.probe import l2
from paramserver.core.records import STATS_WORKERS

if TYPE_CHECKING:  # core imports this module to report itself
    from paramserver.core.shard import ShardCore

__all__ = ["stats"]

def stats(core: ShardCore) -> dict[str, Any]:
    """``core``'s state as a JSON-able summary, bounded whatever its worker table holds."""
    live = core.live()
    momentum = core.stepper.momentum
    listed = list(core.workers.values())
    if len(listed) > STATS_WORKERS:
        listed = sorted(listed,
                        key=lambda w: (not (w.live and not w.finished), -w.last_seen)
                        )[:STATS_WORKERS]
    ssp = core.mode.mode == "ssp"
    return {
        "shard": core.config.shard,
        "mode": core.mode.describe(),
        "policy": core.policy.describe(),
        "version": core.version,
        "initialized": core.initialized,
        "started": core.started,
        "lr": core.lr,
        "lr_scaling": core.stepper.lr_rule.describe(),
        "lr_factor": core.stepper.lr_factor,
        "momentum_target": momentum.target if momentum is not None else None,
        "momentum_explicit": momentum.explicit if momentum is not None else None,
        "momentum_implicit": momentum.implicit if momentum is not None else None,
        "mean_staleness_estimate": momentum.mean_staleness if momentum is not None else None,
        "live_workers": sorted(w.worker for w in live)[:STATS_WORKERS],
        "live_count": len(live),
        "min_clock": core.min_clock(),
        "clock_gap": core.clock_gap(),
        "max_answered_gap": core.max_answered_gap,
        "staleness_bound": core.bound if ssp else None,
        "staleness_bound_max": core.max_bound if ssp else None,
        "pending_pulls": core.pending_pulls(),
        "rounds_dropped": core.rounds_dropped,
        "steps_refused": core.stepper.refused,  # undone: they made something NaN or Inf
        "rounds_voided": core.rounds_voided,
        "rounds_in_place": core.round.in_place,
        "rounds_ahead": core.ahead.committed,
        "ahead_found_busy": core.ahead.found_busy,
        # in the weights' own dtype: a float64 copy of each slice would be a peak
        "weight_norm": math.sqrt(sum(l2(p.detach()) ** 2 for p in core.params.values())),
        # bounded whatever the table holds (a map over 4096 entries would not even
        # decode): live workers first, then the most recently seen
        "workers": {str(w.worker): w.summary() for w in listed},
        "workers_known": len(core.workers),
        "workers_listed": len(listed),
        "workers_evicted": core.workers_evicted,
    }

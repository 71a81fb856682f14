"""The pull gate of a :class:`~paramserver.core.shard.ShardCore`: when a parked pull is answered.

A pull is parked as a token (:func:`request`) and answered by :func:`ready` once
its gate opens: after the weights are seeded; in sync, once the round the worker
contributed to has closed; in SSP, once the worker's clock is within the bound of
the slowest live worker's, a bound a policy may move from what the shard measured
(:func:`update_bound`); observers at once, or, for a final pull, once every
expected worker is done. These rules read and write the core's state but are one
concern of their own, so they live apart from the push and round rules in
shard.py; like them they do no I/O and take time as an argument.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import TYPE_CHECKING

from paramserver.core import rules
from paramserver.core.records import Mode, PendingPull, PullReply
from paramserver.errors import ErrorCode, ProtocolError
from paramserver.policies.base import BoundStats

if TYPE_CHECKING:  # the core calls these on itself
    from paramserver.core.corestate import CoreState

# the shard's logger: these lines are the shard core's
log = logging.getLogger("paramserver.core.shard")


def request(
    core: CoreState, worker: int, clock: int, token: Hashable, now: float,
    observer: bool = False, wait_init: bool = False, final: bool = False,
) -> None:
    """Park a pull; it is answered through :func:`ready` when its gate opens.

    Observers (evaluators, status tools) are never gated and have no clock.
    With ``wait_init`` a pull before any INIT waits for the weights (a worker
    that leaves the seeding to another) instead of being refused. An observer's
    ``final`` pull waits until :meth:`ShardCore.holding` is empty: the final weights.
    """
    if not core.initialized and core.seeding.owner is None and not wait_init:
        raise ProtocolError(
            ErrorCode.NOT_INITIALIZED, "no weights yet: the first worker must send INIT"
        )
    if not observer:
        state = core.members.known(worker)
        state.last_seen = now
        if not state.live:
            raise ProtocolError(
                ErrorCode.NOT_REGISTERED,
                f"worker {worker} is not in the live set (finished or timed out); say HELLO",
            )
        if clock < 0:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"clock must be >= 0, got {clock}")
        state.clock = max(state.clock, clock)
        state.pulls += 1
    # a retried pull replaces the worker's parked one (one reply per worker)
    core.pulls.park(PendingPull(worker, clock, token, now, observer, final and observer))


def gate_open(core: CoreState, pull: PendingPull, min_clock: int) -> bool:
    if not core.initialized:  # a worker is seeding the weights in parts
        return False
    if pull.observer:  # a final one once every expected worker is done here
        return not pull.final or not core.holding(core.config.expected_workers)
    if not core.members.started:
        return False
    if core.mode.mode == Mode.SYNC:
        return pull.worker not in core.round.members
    if core.mode.mode == Mode.SSP:
        state = core.members.workers[pull.worker]
        return state.clock - min_clock <= core.bound
    return True


def update_bound(core: CoreState, now: float) -> None:
    """Ask the policy for the SSP bound, from what this shard measured so far."""
    live = core.members.live()
    clocks = [w.clock for w in live] or [0]
    stats = BoundStats(
        now=now, configured=core.mode.staleness_bound, current=core.bound,
        live_workers=len(live), min_clock=min(clocks), max_clock=max(clocks),
        pushes=core.totals.pushes, staleness_sum=core.totals.staleness_sum,
        pulls=core.totals.pulls, wait_seconds=core.totals.wait_seconds,
        blocked_pulls=core.pulls.blocked(),
    )
    bound = rules.ssp_bound(core.policy, stats, core.mode.staleness_bound)
    if bound != core.bound:
        log.debug("shard %d: SSP bound %d -> %d", core.config.shard, core.bound, bound)
        core.bound = bound
        core.max_bound = max(core.max_bound, bound)


def ready(core: CoreState, now: float) -> list[PullReply]:
    """Pop every parked pull whose gate is open now, oldest first."""
    if core._bound_hook:
        update_bound(core, now)
    replies: list[PullReply] = []
    min_clock = core.members.min_clock()  # no clock moves while pulls are answered
    for pull in core.pulls.take(lambda p: gate_open(core, p, min_clock)):
        waited = now - pull.since
        clock = pull.clock
        if not pull.observer:
            state = core.members.workers[pull.worker]
            clock = state.clock
            core.max_answered_gap = max(core.max_answered_gap, state.clock - min_clock)
            core.totals.answered(waited)
            state.answered(waited)
            if core.policy.needs_read_weights:
                core.read_weights[pull.worker] = {
                    k: p.detach().clone() for k, p in core.params.items()
                }
        replies.append(PullReply(pull.worker, pull.token, core.version, clock, waited))
    return replies

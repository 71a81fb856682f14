"""Membership rules of a shard's core: who is registered, live, finished or dead,
and the clock a worker resumes at. Part of :class:`~paramserver.core.ShardCore`
(a base class of it, kept apart for the size of core.py); pure, as the core is.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .errors import ErrorCode, ProtocolError
from .records import WorkerState

if TYPE_CHECKING:
    import torch

    from .records import CoreConfig, PullQueue
    from .rounds import Seeding, SyncRound

__all__ = ["Membership"]

log = logging.getLogger("paramserver.core")


class Membership:
    """Registration, liveness and clocks of a shard's workers (see core.py)."""

    # the core's state these rules read and change (set in ShardCore.__init__)
    config: CoreConfig
    workers: dict[int, WorkerState]
    workers_evicted: int
    pulls: PullQueue
    seeding: Seeding
    round: SyncRound
    read_weights: dict[int, dict[str, torch.Tensor]]
    started: bool

    def _drop_unfinished(self, worker: int, why: str) -> None:
        raise NotImplementedError  # the push rules' (ShardCore)

    def _maybe_close_round(self) -> bool:
        raise NotImplementedError  # the sync round's rules (ShardCore)

    def register(self, worker: int, incarnation: str, now: float) -> WorkerState:
        """A worker says HELLO. Returns its state (its ``clock`` is where it resumes).

        A new incarnation of a live worker is refused while the old one still
        shows signs of life (two processes with one id); once it has gone
        quiet the newcomer takes over, at the current minimum live clock.
        """
        if worker < 0:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"worker id must be >= 0, got {worker}")
        state = self.workers.get(worker)
        if state is None:
            if len(self.workers) >= self.config.worker_limit:
                self._evict(now)
            state = WorkerState(worker, incarnation, now, clock=self._rejoin_clock(0))
            self.workers[worker] = state
        elif state.incarnation != incarnation:
            quiet_for = now - state.last_seen
            if state.live and not state.finished and quiet_for <= self.config.heartbeat_timeout:
                raise ProtocolError(
                    ErrorCode.DUPLICATE_WORKER,
                    f"worker {worker} is already registered by another process, last heard "
                    f"{quiet_for:.1f}s ago; retry after the heartbeat timeout "
                    f"({self.config.heartbeat_timeout:g}s) or use another worker id",
                )
            self.pulls.drop(worker)
            self._drop_unfinished(worker, "its worker restarted")
            state.restart(incarnation, now)
            state.clock = self._rejoin_clock(state.clock, exclude=worker)
            log.info("worker %d rejoined at clock %d", worker, state.clock)
        else:
            state.last_seen = now
            if not state.live or state.finished:
                state.live, state.finished = True, False
                state.clock = self._rejoin_clock(state.clock, exclude=worker)
        if not self.started and len(self.workers) >= self.config.expected_workers:
            self.started = True
        return state

    def _evict(self, now: float) -> None:
        """Make room in a full worker table, or refuse the newcomer.

        Evicted first: the longest-quiet entry that never became active (a HELLO
        and nothing else), then one dead or finished for longer than the
        heartbeat timeout. Live workers that pulled or pushed are never evicted,
        so a flood of HELLOs cannot push a training worker out.
        """
        idle = [w for w in self.workers.values()
                if not w.active and self.seeding.owner != w.worker]
        gone = [w for w in self.workers.values()
                if (not w.live or w.finished)
                and now - w.last_seen > self.config.heartbeat_timeout]
        pick = min(idle or gone, key=lambda w: w.last_seen, default=None)
        if pick is None:
            raise ProtocolError(
                ErrorCode.TOO_MANY_WORKERS,
                f"the worker table is full ({len(self.workers)} of "
                f"{self.config.worker_limit}, all active); raise --max-workers",
            )
        self.forget(pick.worker)
        self.workers_evicted += 1

    def forget(self, worker: int) -> None:
        """Drop every trace of ``worker`` (evicted from the table)."""
        state = self.workers.pop(worker, None)
        if state is None:
            return
        self._drop_unfinished(worker, "its entry was evicted")
        self.pulls.drop(worker)
        self.read_weights.pop(worker, None)
        if worker in self.round.members:
            # it contributed to the open round: that gradient stays, counted
            log.info("worker %d evicted while in the open round", worker)
        self._maybe_close_round()

    def _rejoin_clock(self, own: int, exclude: int | None = None) -> int:
        clocks = [w.clock for w in self.live() if w.worker != exclude]
        return max(own, min(clocks)) if clocks else own

    def heartbeat(self, worker: int, now: float) -> None:
        state = self._known(worker)
        if state.reported_dead:
            return
        state.last_seen = now
        if not state.live and not state.finished:
            # a worker declared dead spoke again: it is back, at the minimum clock
            state.live = True
            state.clock = self._rejoin_clock(state.clock, exclude=worker)

    def leave(self, worker: int, now: float) -> None:
        """A worker finished its work: it no longer holds anyone back."""
        state = self._known(worker)
        state.last_seen = now
        self._drop_unfinished(worker, "its worker said BYE")
        state.finished = True
        state.live = False
        self.pulls.drop(worker)
        self.read_weights.pop(worker, None)  # it will pull again before it pushes again
        self._maybe_close_round()

    def expire(self, now: float) -> list[int]:
        """Declare workers silent for longer than the heartbeat timeout dead; return them."""
        dead = []
        for state in self.live():
            if now - state.last_seen > self.config.heartbeat_timeout:
                self._bury(state)
                dead.append(state.worker)
                log.warning(
                    "worker %d missed heartbeats for %.1fs (timeout %gs): "
                    "removed from the live set",
                    state.worker, now - state.last_seen, self.config.heartbeat_timeout,
                )
        if dead:
            self._maybe_close_round()
        return dead

    def declare_dead(self, worker: int) -> bool:
        """A supervisor saw ``worker``'s process die: drop it now, not after the timeout.

        Returns False when there was nothing to do (unknown, finished or already
        dead). Its clock is kept, so a restarted process rejoins as after a timeout.
        """
        state = self.workers.get(worker)
        if state is None or not state.live or state.finished:
            return False
        self._bury(state)
        state.reported_dead = True
        log.warning("worker %d reported dead by its supervisor: removed from the live set",
                    worker)
        self._maybe_close_round()
        return True

    def _bury(self, state: WorkerState) -> None:
        self._drop_unfinished(state.worker, "its worker died")
        state.live = False
        state.deaths += 1
        self.pulls.drop(state.worker)

    def holding(self, expected: int) -> list[int]:
        """The workers the job still waits for here: each id in ``0 .. expected-1`` that
        never said HELLO, and every live one. Empty once each has said BYE or died, as
        this shard saw it over its own (under CURVE, authenticated) connections."""
        return sorted({w for w in range(expected) if w not in self.workers}
                      | {w.worker for w in self.live()})

    def live(self) -> list[WorkerState]:
        """The live set: workers neither dead nor finished."""
        return [w for w in self.workers.values() if w.live and not w.finished]

    def _known(self, worker: int) -> WorkerState:
        state = self.workers.get(worker)
        if state is None:
            raise ProtocolError(ErrorCode.NOT_REGISTERED, f"worker {worker} has not said HELLO")
        return state

    def min_clock(self) -> int:
        live = self.live()
        return min(w.clock for w in live) if live else 0

    def clock_gap(self) -> int:
        live = self.live()
        return max(w.clock for w in live) - min(w.clock for w in live) if live else 0

"""Membership rules of a shard's core: who is registered, live, finished or dead,
left out as a straggler, and the clock a worker resumes at. A :class:`Membership`
holds the worker table and is owned by a :class:`~paramserver.core.shard.ShardCore`,
which hands it what it reads of the rest (the open round, the parked pulls, the
seeding) and is told when a worker goes (:class:`Departures`); pure, as the core is.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from typing import TYPE_CHECKING, Protocol

from paramserver.core.records import Mode, WorkerState
from paramserver.errors import ErrorCode, ProtocolError

if TYPE_CHECKING:
    import torch

    from paramserver.core.records import CoreConfig, PullQueue
    from paramserver.core.rounds import Seeding, SyncRound

__all__ = ["IN_USE_BEATS", "ROUND_TIMEOUT_BEATS", "ROUND_TIMEOUT_STEPS", "Departures",
           "Membership", "check_run"]

log = logging.getLogger("paramserver.core.shard")

#: a new incarnation refused this many heartbeat timeouts while the old one stayed
#: live is a second process with the id, not a restart: a dead process would have
#: gone quiet by then (one timeout), and messages it left in flight long arrived
IN_USE_BEATS = 2
#: the default round deadline: at least this many heartbeat timeouts ...
ROUND_TIMEOUT_BEATS = 3
#: ... and this many times the usual time between a worker's pushes (one step)
ROUND_TIMEOUT_STEPS = 10
PACES = 32  # the recent push intervals the usual step time is the median of
CONTENDERS = 4  # incarnations remembered per worker id as refused while it was live


def check_run(own: str | None, theirs: str | None, who: str, shard: str) -> None:
    """Refuse (``wrong_run``) a peer of another run than this shard's. Two runs mix
    only when both name one and they differ: a shard or a worker started by hand
    names none, and takes (or is taken by) any, as before run ids."""
    if own and theirs and own != theirs:
        raise ProtocolError(
            ErrorCode.WRONG_RUN,
            f"{who} is of run {theirs}, but {shard} is of run {own}: another run's "
            f"process took over this address (its own shard is gone), or the address is "
            f"stale")


class Departures(Protocol):
    """What a membership reads of its core and tells it (ShardCore)."""

    @property
    def initialized(self) -> bool:
        """Whether the weights are seeded (no straggler is left out before)."""

    @property
    def bound(self) -> int:
        """The SSP bound in force."""

    def drop_unfinished(self, worker: int, why: str, restart: bool = False) -> None:
        """``worker`` is gone or (``restart``) starts over with new push ids: what it
        left unfinished (a push in parts, a seeding, a parked sparse push) goes."""

    def maybe_close_round(self) -> bool:
        """Close the open sync round if the workers it waits for changed so that it may."""


class Membership:
    """Registration, liveness and clocks of a shard's workers.

    ``config``: the core's configuration (mode, limits, timeouts); ``core``: told of
    departures (:class:`Departures`); ``round``, ``pulls``, ``seeding`` and
    ``read_weights``: the core's open sync round, parked pulls, INIT in parts and
    the weights each worker read, which these rules read (and drop a gone
    worker's pull and read weights from)."""

    def __init__(self, config: CoreConfig, core: Departures, *, round: SyncRound,
                 pulls: PullQueue, seeding: Seeding,
                 read_weights: dict[int, dict[str, torch.Tensor]]) -> None:
        self.config = config
        self.mode = config.mode
        self.core = core
        self.round = round
        self.pulls = pulls
        self.seeding = seeding
        self.read_weights = read_weights
        self.workers: dict[int, WorkerState] = {}
        self.workers_evicted = 0  # entries dropped from a full table (see _evict)
        self.started = False  # the start barrier: expected_workers registered once
        # live workers no round or SSP gate waits for any more (see leave_out)
        self.left_out: set[int] = set()
        self.paces: deque[float] = deque(maxlen=PACES)  # recent intervals between pushes
        # a resumed run's workers not back yet (see await_restored)
        self.awaited: set[int] = set()

    def await_restored(self) -> list[int]:
        """The whole run resumes from checkpoints: the workers are new processes, still
        starting, not dead ones. Every expected id that had not finished is awaited
        (every one, when all had: the run that ended goes on, ``--steps`` further):
        it is not in the live set (no heartbeat timeout runs for it), its HELLO takes
        its id over at once (no process holds it), and the start barrier stands again
        until each is back or its supervisor reports it dead (:meth:`declare_dead`):
        no pull is answered, so no round closes with whichever worker came first.
        Returns the awaited ids."""
        finished = {w.worker for w in self.workers.values() if w.finished}
        expected = set(range(self.config.expected_workers))
        if expected <= finished:  # the run had ended: resumed, it goes on with all of them
            finished = set()
        self.awaited = expected - finished
        for state in self.workers.values():
            if state.worker in self.awaited:
                state.live = False
        self.left_out.clear()
        self.started = False
        self._check_started()
        return sorted(self.awaited)

    def _check_started(self) -> None:
        if not self.started and not self.awaited \
                and len(self.workers) >= self.config.expected_workers:
            self.started = True

    def register(self, worker: int, incarnation: str, now: float,
                 origin: str = "") -> WorkerState:
        """A worker says HELLO. Returns its state (its ``clock`` is where it resumes).

        A new incarnation of a live worker is refused while the old one still
        shows signs of life: a restarted process is refused with DUPLICATE_WORKER
        and retries, and once the old one has gone quiet (it died) takes over, at
        the current minimum live clock. A newcomer refused for IN_USE_BEATS
        heartbeat timeouts while the old one stayed live, or whose old one said
        BYE meanwhile, is a second process with the id: WORKER_IN_USE, final.
        ``origin``: who runs this incarnation, named to such a second process.
        """
        if worker < 0:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"worker id must be >= 0, got {worker}")
        state = self.workers.get(worker)
        if state is None:
            if len(self.workers) >= self.config.worker_limit:
                self._evict(now)
            state = WorkerState(worker, incarnation, now, clock=self._rejoin_clock(0),
                                origin=origin)
            self.workers[worker] = state
        elif state.incarnation != incarnation:
            self._contend(state, incarnation, now)
            self.pulls.drop(worker)
            self.left_out.discard(worker)
            state.origin = origin
            self.core.drop_unfinished(worker, "its worker restarted", restart=True)
            state.restart(incarnation, now)
            state.clock = self._rejoin_clock(state.clock, exclude=worker)
            log.info("worker %d rejoined at clock %d", worker, state.clock)
        else:
            state.last_seen = now
            if not state.live or state.finished:
                state.live, state.finished = True, False
                self.left_out.discard(worker)
                state.clock = self._rejoin_clock(state.clock, exclude=worker)
        self.awaited.discard(worker)
        self._check_started()
        return state

    def _contend(self, state: WorkerState, incarnation: str, now: float) -> None:
        """Another incarnation says HELLO with ``state``'s id: return if it may take the
        id over (the old process is gone), else raise the refusal (see register)."""
        timeout = self.config.heartbeat_timeout
        quiet_for = now - state.last_seen
        first = state.contenders.get(incarnation)
        who = state.origin or f"incarnation {state.incarnation[:12]}"
        if state.live and not state.finished and quiet_for <= timeout:
            if first is not None and now - first > IN_USE_BEATS * timeout:
                raise ProtocolError(
                    ErrorCode.WORKER_IN_USE,
                    f"rank {state.worker} is already in use by a live worker ({who}), heard "
                    f"{quiet_for:.1f}s ago and still heartbeating after this process waited "
                    f"{now - first:.0f}s; give each worker its own --rank")
            if first is None:
                while len(state.contenders) >= CONTENDERS:
                    del state.contenders[min(state.contenders, key=state.contenders.__getitem__)]
                state.contenders[incarnation] = now
            raise ProtocolError(
                ErrorCode.DUPLICATE_WORKER,
                f"worker {state.worker} is already registered by another process ({who}), "
                f"last heard {quiet_for:.1f}s ago; retry after the heartbeat timeout "
                f"({timeout:g}s) or use another worker id",
            )
        if state.finished and first is not None:
            # it was live when this process first asked, and then finished its work:
            # not a restart of a dead process, a second one that waited it out
            raise ProtocolError(
                ErrorCode.WORKER_IN_USE,
                f"rank {state.worker} is already in use by a live worker ({who}), which "
                f"finished its work while this process waited; give each worker its own "
                f"--rank")

    def _evict(self, now: float) -> None:
        """Make room in a full worker table, or refuse the newcomer.

        Evicted first: the longest-quiet entry that never became active (a HELLO
        and nothing after it: no INIT, heartbeat, pull or push), then one dead or
        finished for longer than the heartbeat timeout. A registered worker that
        spoke after its HELLO and is live is never evicted, so a flood of HELLOs
        cannot push a worker out, not even between its INIT and its first pull;
        a table full of such workers refuses newcomers (TOO_MANY_WORKERS).
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
                f"{self.config.worker_limit}, all live workers); retry once one leaves, "
                f"or raise --max-workers",
            )
        log.debug("worker table full: evicting worker %d", pick.worker)
        self.forget(pick.worker)
        self.workers_evicted += 1

    def forget(self, worker: int) -> None:
        """Drop every trace of ``worker`` (evicted from the table)."""
        state = self.workers.pop(worker, None)
        if state is None:
            return
        self.left_out.discard(worker)
        self.core.drop_unfinished(worker, "its entry was evicted", restart=True)
        self.pulls.drop(worker)
        self.read_weights.pop(worker, None)
        if worker in self.round.members:
            # it contributed to the open round: that gradient stays, counted
            log.info("worker %d evicted while in the open round", worker)
        self.core.maybe_close_round()

    def _rejoin_clock(self, own: int, exclude: int | None = None) -> int:
        clocks = [w.clock for w in self.pacing() if w.worker != exclude]
        return max(own, min(clocks)) if clocks else own

    def heartbeat(self, worker: int, now: float) -> None:
        state = self.known(worker)
        if state.reported_dead:
            return
        state.last_seen = now
        state.spoke = True
        if not state.live and not state.finished:
            # a worker declared dead spoke again: it is back, at the minimum clock
            state.live = True
            self.left_out.discard(worker)
            state.clock = self._rejoin_clock(state.clock, exclude=worker)
            self.awaited.discard(worker)
            self._check_started()

    # ------------------------------------------------------------------ stragglers

    def round_deadline(self) -> float:
        """Seconds an open sync round or a closed SSP gate waits on a live member that
        does not push, before leaving it out (0: forever). ``round_timeout`` if set,
        else the larger of ROUND_TIMEOUT_BEATS heartbeat timeouts and
        ROUND_TIMEOUT_STEPS times the usual step (the median recent interval between
        a worker's pushes): a default far past a slow step, so only a member that
        stopped pushing is left out, never one a noisy machine delayed."""
        if self.config.round_timeout is not None:
            return self.config.round_timeout
        floor = ROUND_TIMEOUT_BEATS * self.config.heartbeat_timeout
        if len(self.paces) < 4:
            return floor
        return max(floor, ROUND_TIMEOUT_STEPS * statistics.median(self.paces))

    def pushed(self, state: WorkerState, now: float) -> None:
        """A new push from ``state``'s worker (called before it is decided): the pace
        it keeps, and, if it was left out, it is back, at the minimum clock of the
        others (the push is then judged by the usual staleness rules)."""
        worker = state.worker
        if worker in self.left_out:
            self.left_out.discard(worker)
            state.clock = self._rejoin_clock(state.clock, exclude=worker)
            log.info("worker %d pushed again after it was left out: it rejoins at clock %d",
                     worker, state.clock)
        elif state.pushes > 0:
            self.paces.append(now - state.pushed_at)
        state.pushed_at = now

    def leave_out(self, now: float) -> list[int]:
        """Leave out the live members an open sync round or a closed SSP gate has
        waited on for longer than :meth:`round_deadline` without a push from them; as
        a sync round leaves out its backup workers, it then closes without them, and
        the SSP gate stops counting their clocks. They are still live (they may be
        heartbeating) and rejoin when they push again (:meth:`pushed`). Returns them."""
        wait = self.round_deadline()
        if not wait or not self.core.initialized or not self.started:
            return []
        if self.mode.mode == Mode.SYNC:
            opened = self.round.opened
            if opened is None or not self.round.members or now - opened <= wait:
                return []
            waited_on = [w for w in self.pacing()
                         if w.worker not in self.round.members
                         and w.worker not in self.round.streams]  # parts arriving: not silent
        elif self.mode.mode == Mode.SSP:
            min_clock = self.min_clock()
            held = [self.workers[p.worker].clock for p in self.pulls.pulls
                    if not p.observer and p.worker in self.workers
                    and now - p.since > wait
                    and self.workers[p.worker].clock - min_clock > self.core.bound]
            if not held:
                return []
            needed = max(held) - self.core.bound  # a member below this clock holds a pull
            waited_on = [w for w in self.pacing() if w.clock < needed]
        else:
            return []
        silent = sorted(w.worker for w in waited_on if now - w.pushed_at > wait)
        for worker in silent:
            self.left_out.add(worker)
            log.warning("worker %d is live but pushed nothing for %.1fs (round deadline "
                        "%gs): left out of the %s until it pushes again", worker,
                        now - self.workers[worker].pushed_at, wait,
                        "round" if self.mode.mode == Mode.SYNC else "SSP gate")
        if silent:
            self.core.maybe_close_round()
        return silent

    def leave(self, worker: int, now: float) -> None:
        """A worker finished its work: it no longer holds anyone back."""
        state = self.known(worker)
        state.last_seen = now
        self.left_out.discard(worker)
        self.core.drop_unfinished(worker, "its worker said BYE")
        state.finished = True
        state.live = False
        self.pulls.drop(worker)
        self.read_weights.pop(worker, None)  # it will pull again before it pushes again
        self.core.maybe_close_round()

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
            self.core.maybe_close_round()
        return dead

    def apply_decided(self, kind: str, workers: list[int]) -> list[int]:
        """The deaths (``kind`` "dead") or leave-outs ("left_out") another replica's
        timers decided in one tick, as :meth:`expire` and :meth:`leave_out` apply their
        own: all of them, then the round closes if it can. Returns the workers buried."""
        buried = []
        for worker in workers:
            state = self.workers.get(worker)
            if state is None:
                continue
            if kind == "left_out":
                self.left_out.add(worker)
            elif state.live:
                self._bury(state)
                buried.append(worker)
        self.core.maybe_close_round()
        return buried

    def declare_dead(self, worker: int) -> bool:
        """A supervisor saw ``worker``'s process die: drop it now, not after the timeout.

        Returns False when there was nothing to do (unknown, finished or already
        dead). Its clock is kept, so a restarted process rejoins as after a timeout.
        """
        state = self.workers.get(worker)
        if worker in self.awaited:  # it never came back: the barrier stops waiting
            self.awaited.discard(worker)
            self._check_started()
            if state is not None:
                state.deaths += 1
                state.reported_dead = True
            log.warning("worker %d reported dead by its supervisor before it came back",
                        worker)
            self.core.maybe_close_round()
            return True
        if state is None or not state.live or state.finished:
            return False
        self._bury(state)
        state.reported_dead = True
        log.warning("worker %d reported dead by its supervisor: removed from the live set",
                    worker)
        self.core.maybe_close_round()
        return True

    def _bury(self, state: WorkerState) -> None:
        self.core.drop_unfinished(state.worker, "its worker died")
        self.left_out.discard(state.worker)
        state.live = False
        state.deaths += 1
        self.pulls.drop(state.worker)

    def holding(self, expected: int) -> list[int]:
        """The workers the job still waits for here: each id in ``0 .. expected-1`` that
        never said HELLO, and every live one. Empty once each has said BYE or died, as
        this shard saw it over its own (under CURVE, authenticated) connections."""
        return sorted({w for w in range(expected) if w not in self.workers}
                      | {w.worker for w in self.live()} | self.awaited)

    def live(self) -> list[WorkerState]:
        """The live set: workers neither dead nor finished."""
        return [w for w in self.workers.values() if w.live and not w.finished]

    def pacing(self) -> list[WorkerState]:
        """The live workers rounds and SSP gates wait for: all but those left out
        (or all of them, if every one is)."""
        live = self.live()
        return [w for w in live if w.worker not in self.left_out] or live

    def live_ids(self) -> list[int]:
        return [w.worker for w in self.live()]

    def pacing_ids(self) -> list[int]:
        return [w.worker for w in self.pacing()]

    def heard(self, worker: int, now: float) -> WorkerState:
        """A request of ``worker`` (a sign of life): its state, if it is registered and
        has not said BYE; else the ProtocolError to answer."""
        state = self.known(worker)
        if state.finished:
            raise ProtocolError(ErrorCode.NOT_REGISTERED,
                                f"worker {worker} said BYE; say HELLO first")
        state.last_seen = now
        return state

    def known(self, worker: int) -> WorkerState:
        state = self.workers.get(worker)
        if state is None:
            raise ProtocolError(ErrorCode.NOT_REGISTERED, f"worker {worker} has not said HELLO")
        return state

    def min_clock(self) -> int:
        """The slowest clock of the workers an SSP gate waits for."""
        live = self.pacing()
        return min(w.clock for w in live) if live else 0

    def clock_gap(self) -> int:
        live = self.live()
        return max(w.clock for w in live) - min(w.clock for w in live) if live else 0

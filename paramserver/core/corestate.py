"""What one shard holds: :class:`CoreState`, the fields of a
:class:`~paramserver.core.shard.ShardCore` and what reads them without deciding.

ShardCore (shard.py) adds the rules that change this state; the modules that read
it or save it (pullgate.py, report.py, snapshot.py, transfer.py) take a CoreState,
so that none of them imports the core that calls them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from paramserver.core.ahead import StepAhead
from paramserver.core.membership import Membership
from paramserver.core.probe import Probe
from paramserver.core.pullsqueeze import PullSqueeze
from paramserver.core.records import (
    DTYPES,
    BoundTotals,
    CoreConfig,
    Mode,
    PullQueue,
    SliceSpec,
    WorkerState,
    slice_table,
)
from paramserver.core.rounds import Seeding, SyncRound
from paramserver.core.rows import RowRules
from paramserver.core.stepper import Stepper
from paramserver.policies.base import NoPolicy, StalenessPolicy
from paramserver.util.flat import ELEMENTWISE, JOIN_BYTES, FlatLayout

__all__ = ["CoreState"]

log = logging.getLogger("paramserver.core.shard")


class CoreState:
    """One shard's parameter slices, optimizer, version, workers and parked pulls (the
    rules that change them are ShardCore's: only a ShardCore is built)."""

    def __init__(
        self,
        slices: Sequence[SliceSpec],
        config: CoreConfig | None = None,
        policy: StalenessPolicy | None = None,
    ) -> None:
        self.config = config or CoreConfig()
        self.mode = self.config.mode
        self.policy = policy or NoPolicy()
        self.specs = slice_table(slices)
        # one flat buffer per dtype; each slice's parameters are a view into it
        self.layout = FlatLayout([(s.key, s.numel, DTYPES[s.dtype])
                                  for s in self.specs.values()])
        self.flats, self.params = self.layout.zeros()
        # the optimizer step itself: torch.optim, its scheduler, the step-size rules;
        # on the flat buffers where that is the same step (flat.py)
        self.stepper = Stepper(self.config, list(self.params.values()),
                               flat=self._flat_step())
        # called before every optimizer step: a driver that lends the weights'
        # memory to sends in flight protects them here (copy-on-write)
        self.before_step: Callable[[], None] | None = None
        self.after_step: Callable[[], None] | None = None  # once the version counts it
        # told of a step undone because it made the weights or optimizer state NaN or Inf
        self.on_refused: Callable[[int], None] | None = None
        self.version = 0
        self.initialized = False
        self.seeding = Seeding()  # INIT in parts: who is seeding, which parts are in
        self.pulls = PullQueue()  # parked pulls, answered when their gate opens
        # sync: the open round (its buffer, contributors and pushes arriving in parts)
        self.round = SyncRound(self.params, self.layout)
        # a lone contributor's round stepped part by part, out of place (ahead.py)
        self.ahead = StepAhead(self.layout, self.flats, self.params, self.round)
        # the weights each worker read, for policies that need them (needs_read_weights)
        self.read_weights: dict[int, dict[str, torch.Tensor]] = {}
        # compressed pulls: each worker's reconstruction (pullsqueeze.py; None: off)
        self.squeeze: PullSqueeze | None = None
        # the workers: registration, liveness, clocks, stragglers (membership.py)
        self.members = Membership(self.config, self, round=self.round, pulls=self.pulls,
                                  seeding=self.seeding, read_weights=self.read_weights)
        if not self.mode.backup_workers:  # a round summed by worker id: bit-reproducible
            self.round.roster = self.members.pacing_ids  # (with backups: as pushes come)
        self.round.reopened = self.ahead.drop  # a key stepped ahead was written again
        self.max_answered_gap = 0  # largest clock gap at which a pull was answered
        # ssp: the bound in force; a policy overriding staleness_bound() moves it
        self.bound = self.mode.staleness_bound
        self.max_bound = self.bound  # the largest bound ever in force
        self._bound_hook = (
            type(self.policy).staleness_bound is not StalenessPolicy.staleness_bound
        )
        if self._bound_hook and self.mode.mode != Mode.SSP:
            log.warning("policy %s sets the SSP bound, but the mode is %s: it has no effect",
                        self.policy.name, self.mode.mode)
            self._bound_hook = False
        self.totals = BoundTotals()  # cumulative measurements handed to that policy
        # what a driver's observer (metrics, the watchdog) reads; off until observe()
        self.probe = Probe(self.params, sync=self.mode.mode == Mode.SYNC)
        # the same rules for the pushes of the shard's sparse tables (rows.py)
        self.rows = RowRules(self.mode, self.policy, self.config.shard, self.members,
                             self.config.push_id_window)

    def _flat_step(self) -> tuple[FlatLayout, list[torch.Tensor]] | None:
        """The layout and flat buffers to step when the optimizer's update is
        elementwise and the gradients come flat (sync) or the shard is small."""
        if self.config.optimizer not in ELEMENTWISE or not self.flats:
            return None
        small = all(f.numel() * f.element_size() <= JOIN_BYTES for f in self.flats.values())
        if self.mode.mode != Mode.SYNC and not small:
            return None
        return self.layout, list(self.flats.values())

    # the two rules its membership calls back (membership.Departures): ShardCore's
    def drop_unfinished(self, worker: int, why: str, restart: bool = False) -> None:
        raise NotImplementedError

    def maybe_close_round(self) -> bool:
        raise NotImplementedError

    # ------------------------------------------------------------------ reading

    def pending_pulls(self) -> int:
        return len(self.pulls)

    @property
    def workers(self) -> dict[int, WorkerState]:
        return self.members.workers

    @property
    def workers_evicted(self) -> int:
        return self.members.workers_evicted

    @property
    def started(self) -> bool:
        return self.members.started

    @property
    def left_out(self) -> set[int]:
        return self.members.left_out

    def holding(self, expected: int) -> list[int]:
        return self.members.holding(expected)

    def live(self) -> list[WorkerState]:
        return self.members.live()

    def min_clock(self) -> int:
        return self.members.min_clock()

    def clock_gap(self) -> int:
        return self.members.clock_gap()

    @property
    def between_rounds(self) -> bool:
        """Nothing in the open sync round (always, in the other modes)."""
        return self.mode.mode != Mode.SYNC or self.round.empty()

    @property
    def rounds_voided(self) -> int:
        """Sync rounds closed without a step because a push was given up half-way."""
        return self.round.voided

    @property
    def rounds_dropped(self) -> int:
        """Sync rounds closed with nothing to apply (void ones included)."""
        return self.round.dropped

    @property
    def lr(self) -> float:
        return self.stepper.lr

"""The shard's rules for sparse row pushes (SPUSH): the rules of core/rules.py, which
dense slices obey too, driving a table of rows (paramserver/sparse/shard.py).

What differs from a dense push is the payload alone: the rows are checked,
stepped and held in the open sync round by the table (:class:`RowTable`); which
push is answered again, dropped as late, refused by the staleness policy, held
in the round or stepped, and when the round closes, is decided here, by the
same functions as for dense slices. Sparse push ids are a sequence of their own
(an embedding client numbers its SPUSHes apart from its dense pushes), so their
exactly-once ledger is kept here, beside the workers' dense one.

A sync sparse push is answered when its round closes (its reply is parked:
there is no pull to hold back, as for dense slices): :meth:`RowRules.ready` closes
the round when the workers it waits for are in and returns the answers due.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from paramserver.core import rules
from paramserver.core.records import HoldNote, Mode, ModeSpec, PushOutcome, check_header
from paramserver.policies.base import Decision, StalenessPolicy, UpdateInfo
from paramserver.sparse.shard import RowPush

__all__ = ["Roster", "RowRules", "RowTable"]


class RowTable(Protocol):
    """What the rules do to a table of rows (:class:`~paramserver.sparse.shard.SparseShard`)."""

    @property
    def version(self) -> int:
        """Steps applied to the rows."""

    def check_push(self, read_version: int, tensors: Mapping[str, torch.Tensor]) -> RowPush:
        """The push's rows, checked (else a ProtocolError, nothing changed)."""

    def apply(self, push: RowPush, scale: float) -> None:
        """One step on the push's rows, the learning rate scaled by ``scale``."""

    def hold(self, worker: int, push: RowPush, factor: float) -> None:
        """Add ``factor`` times ``worker``'s push's rows to the open sync round (summed
        by worker id at its close, not in arrival order)."""

    def close_round(self, divisor: float) -> None:
        """One step on the open round's sums divided by ``divisor``."""

    def drop_round(self) -> None:
        """Close the open round without a step."""


class Roster(Protocol):
    """Who a sync round waits for and the SSP clock a policy is told (the membership)."""

    def pacing_ids(self) -> list[int]:
        """The live workers rounds wait for (stragglers left out aside)."""

    def min_clock(self) -> int:
        """The slowest clock of those workers."""


@dataclass
class _Ledger:
    """A worker's last sparse push id and its answer (None: parked in the open round)."""

    push_id: int = -1
    outcome: PushOutcome | None = None


@dataclass
class _Member:
    """A push in the open sync round: its decision, and where its answer goes."""

    decision: Decision
    token: Hashable | None  # None: its worker left or died, nobody to answer
    clock: int


@dataclass
class _Round:
    members: dict[int, _Member] = field(default_factory=dict)
    samples: int = 0  # of the accepted pushes: the divisor of the round's sums


class RowRules:
    """The open sparse sync round, the sparse push ids seen and the answers due, of one
    shard ruled by ``mode`` and ``policy`` (the dense slices' own), its rounds
    waiting for ``roster``'s workers."""

    def __init__(self, mode: ModeSpec, policy: StalenessPolicy, shard: int, roster: Roster,
                 window: int) -> None:
        self.mode = mode
        self.policy = policy
        self.shard = shard
        self.roster = roster
        self.window = window
        self.ledgers: dict[int, _Ledger] = {}
        self.round = _Round()
        self.ready_answers: list[tuple[Hashable, PushOutcome]] = []

    def push(self, table: RowTable, worker: int, push_id: int, read_version: int, clock: int,
             num_samples: int, tensors: Mapping[str, torch.Tensor], token: Hashable
             ) -> PushOutcome | None:
        """A worker's sparse gradients for ``table``. Returns the answer, or None while
        its sync round is open (the answer comes from :meth:`ready`, by ``token``)."""
        ledger = self.ledgers.get(worker)
        if ledger is not None:
            member = self.round.members.get(worker)
            if push_id == ledger.push_id and ledger.outcome is None and member is not None:
                member.token = token  # sent again while its round is open: answered then
                return None
            again = rules.replay(push_id, ledger.push_id, ledger.outcome, table.version)
            if again is not None:
                return again
            rules.check_window(worker, push_id, ledger.push_id, True, self.window)
        check_header(table.version, read_version, clock, num_samples)
        rows = table.check_push(read_version, tensors)
        ledger = self.ledgers.setdefault(worker, _Ledger())
        ledger.push_id, ledger.outcome = push_id, None
        tau = table.version - read_version
        info = UpdateInfo(worker=worker, shard=self.shard, staleness=tau,
                          read_version=read_version, version=table.version, clock=clock,
                          min_clock=self.roster.min_clock(), num_samples=num_samples,
                          rows=rows.rows, stale_rows=rows.stale_rows)
        decision, reason = rules.judge(self.mode.mode, self.policy, info,
                                       worker in self.round.members)
        if decision is None:
            ledger.outcome = rules.refused(reason, tau, table.version)
        elif self.mode.mode == Mode.SYNC:
            if decision.accept:
                table.hold(worker, rows, num_samples * decision.weight)
                self.round.samples += num_samples
            self.round.members[worker] = _Member(decision, token, clock)
            self.close(table)
        elif decision.accept:
            table.apply(rows, decision.weight)
            ledger.outcome = rules.answered(decision, tau, table.version, True)
        else:
            ledger.outcome = rules.answered(decision, tau, table.version, False)
        return ledger.outcome

    def close(self, table: RowTable) -> bool:
        """Close the open sync round when the rules say it may (:func:`rules.round_full`):
        one step on its sample-weighted mean, every member's answer due (that of the
        push that closed it too, which its :meth:`push` also returns)."""
        r = self.round
        if self.mode.mode != Mode.SYNC or not rules.round_full(
                r.members, self.roster.pacing_ids(), self.mode.backup_workers):
            return False
        if r.samples > 0:
            table.close_round(r.samples)
        else:
            table.drop_round()
        stepped = r.samples > 0
        for worker, member in r.members.items():
            outcome = rules.answered(member.decision, 0, table.version, stepped)
            ledger = self.ledgers.get(worker)
            if ledger is not None:
                ledger.outcome = outcome
            if member.token is not None:
                self.ready_answers.append((member.token, outcome))
        self.round = _Round()
        return True

    def ready(self, table: RowTable) -> list[tuple[Hashable, PushOutcome]]:
        """Close the round if it may close now (a member left or died), and take the
        answers due: (token, outcome) each."""
        self.close(table)
        out, self.ready_answers = self.ready_answers, []
        return out

    def holding(self, worker: int) -> HoldNote | None:
        """What ``worker``'s parked sync push waits for, or None if no push of its is
        parked (its heartbeats are told, so its client waits rather than gives up)."""
        member = self.round.members.get(worker)
        if member is None or member.token is None:
            return None
        missing = sorted(w for w in self.roster.pacing_ids() if w not in self.round.members)
        return HoldNote(clock=member.clock,
                        why=f"sparse sync round: waiting for the pushes of workers {missing}")

    def drop_waiting(self, worker: int) -> None:
        """``worker`` left or died: no answer is sent to its parked push (the rows it
        put in the open round stay there, counted)."""
        member = self.round.members.get(worker)
        if member is not None:
            member.token = None

    def forget(self, worker: int) -> None:
        """``worker`` starts over with new push ids (restarted, evicted)."""
        self.drop_waiting(worker)
        self.ledgers.pop(worker, None)

    def reset(self) -> None:
        """The shard was restored from a checkpoint: the open round is not in it (its
        pushes are sent again by their workers) and push ids start afresh."""
        self.ledgers.clear()
        self.round = _Round()
        self.ready_answers = []

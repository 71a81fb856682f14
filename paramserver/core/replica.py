"""The rules of a replicated shard, without I/O: who is primary, at which epoch, and
which replicated input a backup applies next.

A shard's replicas are numbered 0 .. R (0 starts as the primary). The primary sends
its backups every state-changing input in order, each numbered by ``seq`` and tagged
with the ``epoch`` it was sent in; a backup applies the next one in order and
acknowledges it. When the primary falls silent for the failover timeout, a backup
takes over at a higher epoch: from then on any input from a lower epoch is refused,
and the old primary, refused once, steps down (fenced).

With several backups, which one takes over is :func:`elect`'s rule, and the epoch a
replica takes over at is one only it can take (:meth:`ReplicaState.promote`), so two
backups that both promote never hold one epoch: the lower one is refused by the
higher one before it answers a worker (the new primary answers none until each
backup it saw alive holds its snapshot; paramserver/server/replication.py).

A replica that holds no state it may trust (a fenced old primary, or a fresh process
started in place of a dead replica) *joins*: it takes a snapshot of the primary's
state at input ``s``, then the inputs after ``s`` in order, and is a backup from
then on. The primary counts a joining backup among those that hold an input only
once it acknowledged the snapshot.
Time is an argument (monotonic seconds), as in :class:`~paramserver.core.shard.ShardCore`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from paramserver.policies.base import StalenessPolicy

__all__ = ["MAX_REPLICAS", "Candidate", "ReplicaState", "Role", "Takeover", "Verdict",
           "elect", "snapshot_fault", "unreplicable"]

#: backups per shard at most: each one more is one more copy of every input on the
#: primary's network and one more wait before a worker is answered
MAX_REPLICAS = 4


def unreplicable(policy: type[StalenessPolicy]) -> str | None:
    """Why a backup could not follow a shard running ``policy`` bit for bit (None: it
    can). A policy's decisions are pure functions of each push and of the state it
    keeps (which a joining replica's snapshot carries, as a checkpoint does), and
    backup workers close a round on the count of pushes in, in their order, so both
    replicate. Two hooks do not: the weights each worker read (kept by the core for
    the push to come, not in a snapshot) and an SSP bound set from measured wait
    times (each replica measures its own clock)."""
    from paramserver.policies.base import StalenessPolicy

    if policy.needs_read_weights:
        return ("it rewrites gradients from the weights each worker read, which a "
                "joining replica's snapshot does not carry")
    if policy.staleness_bound is not StalenessPolicy.staleness_bound:
        return "it sets the SSP bound from wait times each replica measures on its own clock"
    return None


def snapshot_fault(ours: object | None, theirs: object | None, has_state: bool) -> str | None:
    """Why a snapshot (sealed by a replica of the shard, of an epoch and input it may
    take) is refused all the same, None if it is not: ``ours`` and ``theirs`` are the
    shard plan's descriptions (None: no plan yet), ``has_state`` whether it carries the
    core's state. A snapshot never empties a replica that holds the shard's state, nor
    puts another plan's state in its place (a replica of another run, or a bug)."""
    if theirs is None:
        if ours is not None:
            return "an empty snapshot (no shard plan), while this replica holds a plan's state"
        return None
    if not has_state:
        return "a shard plan without the state it describes"
    if ours is not None and ours != theirs:
        return "a snapshot of another shard plan than this replica's"
    return None


class Role(enum.StrEnum):
    PRIMARY = "primary"
    BACKUP = "backup"
    #: a primary that learnt of a higher epoch: it accepts nothing any more
    FENCED = "fenced"
    #: waiting for the primary's snapshot (fenced before, or started in place of a
    #: dead replica): it applies no input and takes over from no one
    JOINING = "joining"


class Verdict(enum.StrEnum):
    """What a backup does with one replicated input."""

    APPLY = "apply"  # the next in order: apply, then acknowledge
    AGAIN = "again"  # applied already (a resend): acknowledge only
    STALE = "stale"  # from a lower epoch (a deposed primary): refuse, naming ours
    GAP = "gap"  # inputs are missing before it: refuse (a snapshot would be needed)
    HOLD = "hold"  # no snapshot yet: neither applied nor acknowledged


class Takeover(enum.StrEnum):
    """What a backup whose primary fell silent does (:func:`elect`)."""

    PROMOTE = "promote"  # it is the best backup alive: it takes over
    WAIT = "wait"  # the primary answered after all, or a better backup takes over
    FOLLOW = "follow"  # a replica holds a higher epoch: there is a newer primary; join it


@dataclass(frozen=True)
class Candidate:
    """What a replica says of itself when a backup asks (its role probe's answer)."""

    role: Role
    epoch: int
    applied: int
    replica: int
    #: a primary's: the backups it counts, by address (None: not said)
    backups: tuple[str, ...] | None = None


def elect(me: Candidate, peers: Sequence[Candidate], address: str | None = None) -> Takeover:
    """The takeover rule of a backup ``me`` whose primary fell silent, given the answers
    of the peers that answered (a dead one does not).

    A peer at a higher epoch means a newer primary exists (or is taking over): follow
    it. A primary of our own epoch that answers is alive (slow, not dead): wait, unless
    it no longer counts us (``address``) among its backups: it dropped us for silence
    (a paused process, say) and answers workers without us, so we hold none of its
    inputs since and must never take over; we join it again instead. Else
    the backups of our epoch are the candidates, and the one holding the most inputs
    wins, ties going to the lowest replica index; each candidate computes the same
    winner from the same answers. Every input a worker saw acknowledged is on every
    live backup (the primary answers once all of them acknowledged), so the winner
    holds them all; inputs the others hold beyond its own were acknowledged to no
    worker, and they drop them by taking the winner's snapshot.
    Answers can differ between two candidates only if the old primary still sends
    (it is not dead); should both promote anyway, their epochs differ
    (:meth:`ReplicaState.promote`) and the higher one fences the lower."""
    if any(p.epoch > me.epoch for p in peers):
        return Takeover.FOLLOW
    for p in peers:
        if p.role is Role.PRIMARY and p.epoch == me.epoch:
            dropped = address is not None and p.backups is not None and address not in p.backups
            return Takeover.FOLLOW if dropped else Takeover.WAIT
    rivals = [p for p in peers if p.role is Role.BACKUP and p.epoch == me.epoch
              and p.replica != me.replica]
    best = max([me, *rivals], key=lambda c: (c.applied, -c.replica))
    return Takeover.PROMOTE if best is me else Takeover.WAIT


@dataclass
class ReplicaState:
    """One replica's view: its role, the epoch it holds and the last input applied."""

    role: Role
    epoch: int = 0
    applied: int = 0  # sequence number of the last input applied (primary: sent)
    #: when the primary last spoke to this backup (None: never yet; a backup takes
    #: over only from a primary it heard, not from one still starting)
    heard_at: float | None = None
    replica: int = 0  # this replica's index, 0 .. size - 1
    size: int = 1  # the shard's replicas (R + 1); 1: epochs are not split among them

    @classmethod
    def starting(cls, replica: int, size: int = 2, replacement: bool = False) -> ReplicaState:
        """Replica 0 starts as the primary, unless it replaces a dead replica: then,
        like any other, it holds no state until it joined."""
        primary = replica == 0 and not replacement
        return cls(Role.PRIMARY if primary else Role.BACKUP, replica=replica, size=size)

    @property
    def writable(self) -> bool:
        """Whether this replica answers workers (only the primary does)."""
        return self.role is Role.PRIMARY

    def next_seq(self) -> int:
        """The primary numbers its next input."""
        if self.role is not Role.PRIMARY:
            raise RuntimeError(f"a {self.role} replica sends no inputs")
        self.applied += 1
        return self.applied

    def receive(self, epoch: int, seq: int, now: float) -> Verdict:
        """A replicated input (``seq`` 0: a keep-alive) from the primary of ``epoch``."""
        if epoch < self.epoch:
            return Verdict.STALE
        if self.role is Role.PRIMARY and epoch == self.epoch:
            return Verdict.STALE  # two primaries of one epoch cannot be: refuse it
        if self.role is Role.FENCED:
            return Verdict.STALE  # it rejoins by snapshot (rejoin), not input by input
        if self.role is Role.JOINING:
            return Verdict.HOLD  # (the primary sends its snapshot before any input)
        if epoch > self.epoch:  # a new primary's: its snapshot comes first, and brings
            return Verdict.HOLD  # us to its input (we may hold inputs it lacks)
        self.role, self.epoch, self.heard_at = Role.BACKUP, epoch, now
        if seq == 0 or seq <= self.applied:
            return Verdict.AGAIN
        if seq != self.applied + 1:
            return Verdict.GAP
        self.applied = seq
        return Verdict.APPLY

    def silent(self, now: float, timeout: float) -> bool:
        """Whether a backup has heard nothing from its primary for ``timeout`` seconds."""
        return (self.role is Role.BACKUP and self.heard_at is not None
                and now - self.heard_at > timeout)

    def promote(self) -> int:
        """This backup becomes the primary, at a new epoch; returns it. The epoch is the
        next one above ours that is this replica's own (``epoch % size == replica``),
        so two replicas promoted from one epoch never hold the same one. With one
        backup that is always ``epoch + 1`` (a replica does not follow itself)."""
        if self.role is not Role.BACKUP:
            raise RuntimeError(f"only a backup is promoted, not a {self.role} replica")
        self.role = Role.PRIMARY
        self.epoch += 1
        while self.size > 1 and self.epoch % self.size != self.replica % self.size:
            self.epoch += 1
        return self.epoch

    def candidate(self) -> Candidate:
        return Candidate(self.role, self.epoch, self.applied, self.replica)

    def rejoin(self) -> None:
        """A fenced replica (or one just started in place of a dead one) asks the
        primary for its state: it holds none it may apply inputs to."""
        if self.role is Role.PRIMARY:
            raise RuntimeError("a primary does not rejoin: it is fenced first")
        self.role = Role.JOINING
        self.heard_at = None

    def takes_snapshot(self, epoch: int, seq: int) -> bool:
        """Whether a snapshot from the primary of ``epoch`` at input ``seq`` replaces our
        state: while joining, one not below our epoch; a backup's own primary's, one not
        behind us (it dropped and took us again: its inputs to us go on from ``seq``;
        an older one is stale); else one of a higher epoch (a new primary bringing the
        backups it found to its own input, which drops any input it lacks: those were
        acknowledged to no worker; or a rival that promoted at a higher epoch)."""
        if self.role is Role.JOINING:
            return epoch >= self.epoch
        if self.role is Role.BACKUP and epoch == self.epoch:
            return seq >= self.applied
        return epoch > self.epoch

    def joined(self, epoch: int, seq: int, now: float) -> bool:
        """The snapshot of the primary of ``epoch`` at input ``seq`` is applied: a backup
        from now on, next expecting ``seq + 1``. False (and nothing changes) unless
        :meth:`takes_snapshot`."""
        if not self.takes_snapshot(epoch, seq):
            return False
        self.role, self.epoch, self.applied, self.heard_at = Role.BACKUP, epoch, seq, now
        return True

    def writes_checkpoints(self, backups: int, rank: int | None = None) -> bool:
        """Whether this replica writes its shard's checkpoints, ``backups`` being the
        backups a primary counts (each holds its state and every input since), ``rank``
        a backup's place among the primary's backups (its keep-alives list them; None:
        not known). A backup does (at the same input it holds the primary's state, and
        its disk stalls no worker), the first one only when there are several; a
        primary only when alone; a fenced or joining replica never (it holds no state
        of its own). One writes at a time: see paramserver/server/replicackpt.py."""
        if self.role is Role.BACKUP:
            return rank is None or rank == 0
        return self.role is Role.PRIMARY and backups == 0

    def refused(self, epoch: int) -> bool:
        """A backup refused our input naming ``epoch``: a higher one fences us for good.
        Returns whether it did."""
        if epoch > self.epoch and self.role is Role.PRIMARY:
            self.role = Role.FENCED
            self.epoch = epoch
            return True
        return False

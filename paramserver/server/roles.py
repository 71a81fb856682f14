"""Who a shard server is among its shard's replicas, and what that decides for the
socket loop (issues 32 and 44).

The loop (loop.py) asks its role and never looks at replication itself. A role says
what a data message does here (:meth:`ShardRole.route`): handled and answered,
sent to the backups first and answered once they hold it, or dropped; whether this
replica answers workers at all (its parked pulls, its timers' deaths); who writes
the checkpoints; and what runs between two messages.

The roles (:class:`Duties`):

* a **lone primary** (no ``--replicas``, :class:`Lone`): handles and answers
  everything, decides deaths by its own timers, writes its own checkpoints;
* a **replicated primary**: as a lone one, but each input that can change the
  shard's state goes to the backups first, and its answer waits until they hold it;
  the deaths its timers decide go to them too;
* a **backup**: answers no worker (they ask who is primary now, failover.py),
  applies what its primary forwards, as the primary did, and writes the checkpoints
  (replicackpt.py);
* a **joining** replica (fenced, or started in place of a dead one): as a backup,
  but holds no state of its own until the primary's snapshot comes (rejoin.py).

A replicated shard's role changes as it runs (a failover promotes a backup, a
fence demotes a primary): :class:`Replicated` reads it from the replication's state
(replication.py) at each question.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from paramserver.core.replica import Role
from paramserver.server.forwarded import as_tcp
from paramserver.server.replicackpt import ReplicaCheckpoints
from paramserver.server.replication import REPLAYED, REPLICATED_OPS, Replication

if TYPE_CHECKING:
    from paramserver.core.shard import ShardCore
    from paramserver.observe.events import EventLog
    from paramserver.observe.metrics import MetricsRegistry
    from paramserver.server.checkpointer import Capture, Checkpointer
    from paramserver.server.config import ServerConfig
    from paramserver.server.outbox import Outbox
    from paramserver.server.replhost import ReplicationHost
    from paramserver.wire.protocol import Message, Op
    from paramserver.wire.transport import RouterSocket

__all__ = ["BACKUP", "JOINING", "LONE", "PRIMARY", "Duties", "Lone", "Replicated", "Route",
           "ShardRole", "for_shard"]

log = logging.getLogger(__name__)

#: the shard's checkpoint as it is now (``copy``: to be written on a thread)
Take = Callable[[bool], "Capture | None"]


class Route(enum.Enum):
    """What one data message does at this replica."""

    APPLY = "apply"  # handled and answered here
    FORWARD = "forward"  # to the backups first; answered once they hold it
    DROP = "drop"  # not handled: this replica answers no worker


@dataclasses.dataclass(frozen=True)
class Duties:
    """One role's part in its shard's traffic."""

    name: str
    forwards: bool  # the data ops go to the backups before they are handled
    answers: bool  # answers workers and runs the timers (deaths, leave-outs)


LONE = Duties("lone primary", forwards=False, answers=True)
PRIMARY = Duties("replicated primary", forwards=True, answers=True)
BACKUP = Duties("backup", forwards=False, answers=False)
JOINING = Duties("joining", forwards=False, answers=False)


class ShardRole:
    """A lone primary's answers; :class:`Replicated` overrides what replicas change."""

    #: the replication it drives (None: a lone shard)
    replication: Replication | None = None

    def __init__(self, checkpoints: Checkpointer, take: Take, first: bool = True) -> None:
        self.checkpoints = checkpoints
        self.take = take
        #: the shard's first primary (replica 0, not a replacement), or a lone shard: it
        #: claims the checkpoint directory for every replica, and settles a resume there
        self.first = first

    @property
    def duties(self) -> Duties:
        return LONE

    def admit(self, identity: bytes, frames: list[Any], key: str | None) -> bool:
        """Whether ``frames`` go on to the shard's handlers (False: a message of the
        replication's own, handled here)."""
        return True

    def route(self, op: Op, identity: bytes) -> Route:
        """What a data message of ``op`` from ``identity`` does here: a backup answers
        no worker, and handles only what its primary forwarded (REPLAYED)."""
        if op not in REPLICATED_OPS:  # (STATS, CHECKPOINT, ...: they change nothing
            return Route.APPLY        # a replica must hold)
        duties = self.duties
        if duties.forwards:
            return Route.FORWARD
        return Route.APPLY if duties.answers or identity == REPLAYED else Route.DROP

    def forward(self, route: Route, msg: Message, frames: list[Any], key: str | None) -> int:
        """Send a FORWARD input to the backups (not waiting); its sequence number (0:
        nothing sent). Tensors a worker lent through shared memory go as frames."""
        return 0

    def settle(self, seq: int) -> bool:
        """Wait until the backups hold input ``seq``; False when this replica was
        fenced meanwhile (a newer primary holds the shard: answer no one)."""
        return True

    def decided(self, kind: str, workers: list[int]) -> bool:
        """The timers decided deaths or leave-outs (``kind``): the backups apply them
        first; False when fenced."""
        return True

    def tick(self, now: float) -> None:
        """Between two messages: keep-alives, snapshots, takeovers."""

    def export(self, registry: MetricsRegistry, now: float) -> None:
        """The role's gauges (docs/observability.md)."""

    def save_checkpoint(self, directory: str | None) -> str | None:
        """Write the shard's checkpoint now; the manifest path (None: nothing saved)."""
        return self.checkpoints.store(self.take(False), directory)

    def maybe_checkpoint(self, core: ShardCore | None) -> None:
        """A checkpoint when one is due (--checkpoint-every, --checkpoint-seconds)."""
        if self.checkpoints.due(core):
            self.save_checkpoint(None)

    def final_checkpoint(self) -> None:
        """The checkpoint at stop."""
        self.save_checkpoint(None)

    def close(self) -> None:
        """Close what the role opened."""


class Lone(ShardRole):
    """A shard without replicas."""


class Replicated(ShardRole):
    """One replica of a replicated shard: primary, backup or joining as its
    replication's state says now; one of them writes the checkpoints."""

    def __init__(self, replication: Replication, checkpoints: Checkpointer, take: Take,
                 socket: RouterSocket, first: bool) -> None:
        super().__init__(checkpoints, take, first)
        self.replication = replication
        self.repl = replication  # (typed: never None here)
        self.writer = ReplicaCheckpoints(checkpoints, replication, take)
        self.socket = socket

    @property
    def duties(self) -> Duties:
        if self.repl.writable:
            return PRIMARY
        return JOINING if self.repl.state.role in (Role.JOINING, Role.FENCED) else BACKUP

    def admit(self, identity: bytes, frames: list[Any], key: str | None) -> bool:
        return self.repl.admit(identity, frames, self._send_raw, key)

    def _send_raw(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            self.socket.socket.send_multipart([identity, *frames])
        except zmq.ZMQError as exc:  # a peer that is gone
            log.debug("dropping a replication answer: %s", exc)

    def forward(self, route: Route, msg: Message, frames: list[Any], key: str | None) -> int:
        if route is not Route.FORWARD:
            return 0
        return self.repl.forward(as_tcp(msg, frames), key=key)

    def settle(self, seq: int) -> bool:
        return not seq or self.repl.wait(seq)

    def decided(self, kind: str, workers: list[int]) -> bool:
        return not workers or self.repl.wait(self.repl.forward([], kind, workers))

    def tick(self, now: float) -> None:
        self.repl.tick(now)

    def export(self, registry: MetricsRegistry, now: float) -> None:
        self.repl.export(registry, now)

    def save_checkpoint(self, directory: str | None) -> str | None:
        return self.writer.save(directory)  # once this replica holds the writer lock

    def maybe_checkpoint(self, core: ShardCore | None) -> None:
        self.writer.tick()

    def final_checkpoint(self) -> None:
        self.writer.final()  # one of the replicas writes it

    def close(self) -> None:
        self.writer.close()
        self.repl.close()  # (its keep-alive thread too)


def for_shard(host: ReplicationHost, config: ServerConfig, events: EventLog,
              socket: RouterSocket, checkpoints: Checkpointer, take: Take) -> ShardRole:
    """The role a shard starts in: lone without --replicas; else its replication,
    started (a primary announces itself to its backups, which may wait on them)."""
    first = config.replica == 0 and not config.replacement
    if not config.replicas:
        return Lone(checkpoints, take, first)
    replication = Replication(host, config, events, socket.address)
    role = Replicated(replication, checkpoints, take, socket, first)
    try:
        replication.start()
    except BaseException:
        role.close()
        raise
    return role


def close_pulls(core: ShardCore, outbox: Outbox, now: float) -> None:
    """A replica that answers no one closes the pulls whose gates opened as the
    primary answered them, but makes no reply (no one waits for it here), nor a copy
    of the weights. A compressed pull moves the worker's reconstruction on as the
    primary's answer did (the same weights, the same compression): a backup holds it
    bit for bit (core/pullsqueeze.py)."""
    for ready in core.ready_pulls(now):
        if core.squeeze is not None and ready.token not in outbox.observer_pulls:
            core.answer_squeezed(ready.worker, ready.version)
        parked = outbox.push_pulls.get(ready.worker)
        if parked is not None and parked[0] == ready.token:
            del outbox.push_pulls[ready.worker]
            outbox.early.pop(ready.worker, None)
        outbox.observer_pulls.discard(ready.token)

"""ReplicationHost: what a shard's replication asks of the shard server that owns it.

:class:`~paramserver.server.replication.Replication` drives a replica's side of
the protocol (forwarding, acknowledgements, fencing, takeover, joining) and calls
back into the server only through this interface: replay a forwarded input or a
decided death, hand over or restore a snapshot for a joining replica (its state,
shardstate.py), and tell the plan. It is apart
so that the contract between the two is one short page, read without the
protocol's machinery; replication.py re-exports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from paramserver.core.shard import ShardCore
    from paramserver.server.shardstate import ShardImage
    from paramserver.wire import replication as wrepl

__all__ = ["ReplicationHost"]


class ReplicationHost(Protocol):
    """What replication asks of the shard server that owns it."""

    @property
    def core(self) -> ShardCore | None: ...

    def replay(self, frames: list[Any], key: str | None) -> None:
        """Handle a forwarded data message as if a peer sent it (answers go nowhere),
        ``key``: the CURVE key it came to the primary with."""

    def replay_death(self, kind: str, workers: list[int]) -> None:
        """Apply the deaths (``dead``) or leave-outs (``left_out``) the primary decided
        in one tick, as one."""

    def send_state(self) -> ShardImage | None:
        """The shard's state for a joining replica (shardstate.capture); None: not now."""

    def plan_description(self) -> object | None:
        """The shard plan's description as JSON would give it back (None: no plan)."""

    def restore(self, record: wrepl.Snapshot, frames: list[Any]) -> None:
        """Put the primary's snapshot (its record and tensor frames) in place of this
        replica's state (shardstate.receive_snapshot)."""

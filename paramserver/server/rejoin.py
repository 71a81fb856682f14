"""A replica that joins its shard late, by copying the primary's state (issue 32).

Two kinds of replica join: a fresh process the launcher started in place of a dead
replica, and a fenced old primary (it applied inputs the new primary never saw, so
its state is not one to go on from). Either sends :class:`~paramserver.wire.replication.Join`
to its peers (:class:`Joiner`); the primary, between two messages and with no push
or INIT in parts under way, answers with a snapshot of its whole state at its last
input ``s`` (:func:`image`), and from then on forwards its inputs to the new backup
as to any other: they follow the snapshot on the same connection, in order. The
backup puts the snapshot in place of whatever it held (:func:`adopt`), applies the
inputs after ``s`` as they come, and acknowledges; the primary counts it among the
backups that hold an input only from its first acknowledgement on
(paramserver/server/replication.py).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import zmq

from paramserver.core.sharding import ShardPlan
from paramserver.core.transfer import CoreImage, export, quiet, restore
from paramserver.errors import ConfigError, ProtocolError
from paramserver.server.scriptopt import META_KEY
from paramserver.wire import replication as wrepl
from paramserver.wire.curve import CurveKeys, secure_client
from paramserver.wire.replauth import ReplicationKey

if TYPE_CHECKING:
    from paramserver.server.loop import ShardServer

__all__ = ["Joiner", "adopt", "image"]

log = logging.getLogger(__name__)

#: seconds between two Join requests while no snapshot came (a resend is ignored by a
#: primary that has it; a peer that is not the primary ignores every one)
RESEND = 1.0


class Joiner:
    """A joining replica's requests to its peers until the primary's snapshot comes."""

    def __init__(self, peers: Sequence[str], address: str, replica: int,
                 context: zmq.Context[Any], key: ReplicationKey,
                 curve: CurveKeys | None = None) -> None:
        self.address = address
        self.key = key  # (a primary sends its state only to a sealed request)
        self.replica = replica
        self.nonce = secrets.token_hex(8)  # this process's (and this rejoin's) request
        self.started = time.monotonic()
        self._sent = float("-inf")
        self.sockets: list[zmq.Socket[Any]] = []
        for peer in peers:
            s = context.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if curve is not None:  # the peers admit only the shard's own key to ask
                secure_client(s, curve)
            s.connect(peer)
            self.sockets.append(s)

    def renew(self) -> None:
        """Ask again at once, as a new request (the primary answers a request once)."""
        self.nonce = secrets.token_hex(8)
        self._sent = float("-inf")

    def tick(self, now: float) -> None:
        """Ask every peer again, RESEND seconds after the last time."""
        if now - self._sent < RESEND:
            return
        self._sent = now
        for s in self.sockets:
            frames = self.key.seal(wrepl.encode(wrepl.Join(self.replica, self.address,
                                                           self.nonce)))
            with contextlib.suppress(zmq.Again):  # not connected yet: asked next tick
                s.send_multipart(frames, zmq.NOBLOCK)
            while True:  # (peers answer nothing on these sockets)
                try:
                    s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break

    def close(self) -> None:
        for s in self.sockets:
            s.close(0)
        self.sockets = []


def image(server: ShardServer) -> tuple[bytes, CoreImage | None,
                                        dict[str, torch.Tensor]] | None:
    """The shard server's state to send a joining replica: the plan (JSON text), the
    core's records and tensors (copies: the core goes on changing while they are
    sent). None while a push or an INIT in parts is under way (ask again later)."""
    core, plan = server.core, server.plan
    if server.joined.pending or server.streamed.pending:
        return None
    if core is None or plan is None:
        return b"", None, {}
    if not quiet(core):
        return None
    record, tensors = export(core)
    return (msgspec.json.encode(plan.describe()), record,
            {k: v.detach().clone() for k, v in tensors.items()})


def adopt(server: ShardServer, snapshot: wrepl.Snapshot, frames: Sequence[Any]) -> None:
    """Put a primary's snapshot in place of everything ``server`` held: a core built
    from the plan and restored (checked as a resume checks a checkpoint, then the
    rest), and none of the per-worker state a push or pull in flight left. Its tensors
    are checked at the wire first, as a data message's are."""
    tensors = wrepl.snapshot_tensors(snapshot, frames, server.socket.limits)
    plan, record = snapshot.plan, snapshot.core
    server.core = server.plan = None
    server.sparse = server.tables = None
    for parts in (server.joined, server.streamed, server.outbox):
        parts.forget(())
    server.outbox.observer_pulls.clear()
    server.access.owners = dict(snapshot.owners)  # (CURVE: who may act as each worker)
    if not plan:
        return
    try:
        # the script's optimizer first: the core is built with it (scriptopt.py)
        server.script.restore({META_KEY: snapshot.optimizer})
        server.adopt_plan(ShardPlan.from_description(msgspec.json.decode(plan),
                                                     server.config.plan_limits()))
        assert server.core is not None
        if record is not None:
            # its instants are the primary's clock: moved onto ours (another host's
            # monotonic clock counts from another boot)
            restore(server.core, record, tensors, time.monotonic() - snapshot.now)
    except (ConfigError, ProtocolError, msgspec.DecodeError) as exc:
        server.core = server.plan = None  # no half-restored core stays
        server.sparse = server.tables = None
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"snapshot: {exc}") from exc

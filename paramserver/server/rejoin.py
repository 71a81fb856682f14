"""A replica that joins its shard late, by copying the primary's state (issue 32).

Two kinds of replica join: a fresh process the launcher started in place of a dead
replica, and a fenced old primary (it applied inputs the new primary never saw, so
its state is not one to go on from). Either sends :class:`~paramserver.wire.replication.Join`
to its peers (:class:`Joiner`); the primary, between two messages and with no push
or INIT in parts under way, answers with a snapshot of its whole state at its last
input ``s`` (shardstate.capture), and from then on forwards its inputs to the new backup
as to any other: they follow the snapshot on the same connection, in order. The
backup puts the snapshot in place of whatever it held (shardstate.receive_snapshot,
ShardServer.adopt_state), applies the
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
from typing import Any

import zmq

from paramserver.wire import replication as wrepl
from paramserver.wire.curve import CurveKeys, secure_client
from paramserver.wire.replauth import ReplicationKey

__all__ = ["Joiner"]

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

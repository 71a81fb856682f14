"""A backup whose primary fell silent asks the shard's other replicas what they hold,
for :func:`paramserver.core.replica.elect` to decide whether it takes over.

The addresses are those the primary's keep-alives listed (itself and its backups);
the questions are role probes (:class:`~paramserver.wire.replication.WhoIs`), sent at
once, each replica having ``timeout`` to answer (a dead one never does). The answers
are collected between two turns of the shard's loop, never by waiting in it: two
backups that time out together ask each other, and each must go on answering.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import zmq

from paramserver.core.replica import Candidate, Role
from paramserver.errors import ProtocolError
from paramserver.wire import replication as wrepl
from paramserver.wire.curve import CurveKeys, secure_client

__all__ = ["Election"]

log = logging.getLogger(__name__)


class Election:
    """The role probes of one takeover decision, asked at ``now``."""

    def __init__(self, addresses: Sequence[str], now: float, timeout: float,
                 curve: CurveKeys | None = None) -> None:
        ctx: zmq.Context[Any] = zmq.Context.instance()
        self.deadline = now + timeout
        self.found: dict[str, Candidate] = {}
        self._socks: dict[str, zmq.Socket[Any]] = {}
        for a in addresses:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                secure_client(s, curve)
            s.connect(a)
            self._socks[a] = s
            with contextlib.suppress(zmq.Again):  # (no pipe yet: counted as silent)
                s.send_multipart(wrepl.encode(wrepl.WhoIs()), zmq.NOBLOCK)

    def poll(self, now: float) -> dict[str, Candidate] | None:
        """What each replica that answered says of itself, once all answered or the
        time is up (None: not yet)."""
        for address, sock in self._socks.items():
            while address not in self.found:
                try:
                    record, _ = wrepl.decode(sock.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
                except ProtocolError as exc:  # nonsense counts as silence
                    log.debug("role of %s: %s", address, exc)
                    continue
                if isinstance(record, wrepl.RoleReply):
                    self.found[address] = Candidate(Role(record.role), record.epoch,
                                                    record.applied, record.replica,
                                                    tuple(record.backups))
        if len(self.found) < len(self._socks) and now < self.deadline:
            return None
        return self.found

    def close(self) -> None:
        for s in self._socks.values():
            s.close(0)
        self._socks = {}

"""The primary's connection to one backup of its shard: a DEALER with a monitor of its
connection, what the backup acknowledged, and what it has not yet."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from paramserver.server.peerprobe import refused
from paramserver.wire import replication as wrepl
from paramserver.wire.curve import CurveKeys, secure_client

__all__ = ["BackupLink"]


class BackupLink:
    """The primary's connection to one backup.

    A backup is dropped only once its connection has been down for the failover
    timeout and its host refuses a connection to its port (its process died): one
    that is merely slow, paused, or out of reach (a partition: it may be taking over)
    is waited for, since a backup dropped while alive would take over beside us."""

    def __init__(self, address: str, context: zmq.Context[Any],
                 curve: CurveKeys | None = None) -> None:
        self.address = address
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDTIMEO, 100)
        if curve is not None:  # the backup admits only the shard's own key to replicate
            secure_client(self.socket, curve)
        self.monitor = self.socket.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.socket.connect(address)
        self.acked = 0  # the last sequence number it acknowledged
        self.acked_at = time.monotonic()
        self.down_since: float | None = self.acked_at  # (until the first connection)
        self.probed_at = float("-inf")
        #: inputs sent and not acknowledged yet, by sequence number: sent again after a
        #: reconnection (what was in flight on the old connection may be lost)
        self.pending: OrderedDict[int, list[Any]] = OrderedDict()
        self.connected_once = False
        self.reconnected = False

    def send(self, frames: Sequence[Any], wait: bool = True) -> bool:
        try:
            self.socket.send_multipart(frames, 0 if wait else zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:  # no pipe to it (yet), or its queue is full
            return False

    def dead(self, now: float, timeout: float) -> bool:
        """Whether its connection has been down for ``timeout`` seconds and its host
        refuses a connection (peerprobe: a partition is no death); probed at most once
        every ``timeout``."""
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.down_since = self.down_since or now
            elif event["event"] == zmq.EVENT_CONNECTED:
                self.reconnected = self.connected_once
                self.connected_once = True
                self.down_since = None
        if self.down_since is None or now - self.down_since <= timeout \
                or now - self.probed_at < timeout:
            return False
        self.probed_at = now
        return refused(self.address, min(timeout / 4, 0.5))

    def read(self) -> wrepl.Ack | None:
        """One acknowledgement if one is waiting."""
        try:
            frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        record, _ = wrepl.decode(frames)
        return record if isinstance(record, wrepl.Ack) else None

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(0)
        self.socket.close(0)

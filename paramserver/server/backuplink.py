"""The primary's connection to one backup of its shard: a DEALER with a monitor of its
connection, what the backup acknowledged, and what it has not yet; and why it is
refused, when it is (another CURVE key pair, or another replication key)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from paramserver.errors import ProtocolError
from paramserver.server.peerprobe import refused
from paramserver.wire import replication as wrepl
from paramserver.wire.curve import CurveKeys, secure_client
from paramserver.wire.replauth import ReplicationKey

#: the monitor's events that say a CURVE handshake with the backup failed
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

__all__ = ["SILENCE", "BackupLink"]

#: seconds past the failover timeout, at least, that an input waits for a backup whose
#: connection is up before it is dropped: TCP's keep-alive (1 s idle, one probe of 1 s)
#: takes a partitioned one's idle connection down within them
SILENCE = 3.0


class BackupLink:
    """The primary's connection to one backup.

    A backup is dropped only once its connection has been down for the failover
    timeout and its host refuses a connection to its port (its process died): one
    that is merely slow, paused, or out of reach (a partition: it may be taking over)
    is waited for while its connection is down, since a backup dropped while alive
    would take over beside us. A backup whose connection is up but which acknowledges
    nothing is another matter (:meth:`silent`): a paused or stuck process, whose host
    still answers TCP, holds every worker's answer, so it is dropped, and joins again
    once it wakes up (paramserver/server/replication.py). Up means TCP says so: data
    unacknowledged for the failover timeout (TCP_MAXRT), or an idle connection whose
    keep-alive probes go unanswered, take a partitioned backup's connection down
    first, and a partitioned backup is never dropped (it may be taking over)."""

    def __init__(self, address: str, context: zmq.Context[Any], key: ReplicationKey,
                 timeout: float, curve: CurveKeys | None = None) -> None:
        self.address = address
        self.key = key  # what its acknowledgements must be sealed with
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDTIMEO, 100)
        # a partition takes the connection down before silent() could call it paused
        self.socket.setsockopt(zmq.TCP_MAXRT, max(1, int(timeout * 1000)))
        self.socket.setsockopt(zmq.TCP_KEEPALIVE, 1)
        self.socket.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 1)
        self.socket.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 1)
        self.socket.setsockopt(zmq.TCP_KEEPALIVE_CNT, 1)
        if curve is not None:  # the backup admits only the shard's own key to replicate
            secure_client(self.socket, curve)
        self.monitor = self.socket.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
            | (_HANDSHAKE_FAILED if curve is not None else 0))
        self.curve = curve
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
        #: since when an input it has not acknowledged waits (None: none waits)
        self.waiting_since: float | None = None
        #: why it refuses us, when it says or the CURVE handshake does (a mismatch)
        self.mismatch: str | None = None

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
            if event["event"] & _HANDSHAKE_FAILED and self.curve is not None:
                self.mismatch = (
                    f"the CURVE handshake with it failed ({zmq.Event(event['event']).name}): "
                    f"it runs without CURVE, or with another key pair than this replica's "
                    f"(public key {self.curve.public_text})")
            elif event["event"] == zmq.EVENT_DISCONNECTED:
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

    def sent(self, now: float) -> None:
        """An input went out to it: it is waited for from now if nothing was."""
        if self.waiting_since is None:
            self.waiting_since = now

    def acknowledged(self, seq: int, now: float) -> None:
        """It acknowledged every input up to ``seq``."""
        self.acked, self.acked_at = max(self.acked, seq), now
        while self.pending and next(iter(self.pending)) <= self.acked:
            self.pending.popitem(last=False)
        self.waiting_since = now if self.pending else None

    def silent(self, now: float, timeout: float) -> bool:
        """Whether an input has waited for its acknowledgement for :data:`SILENCE`
        beyond ``timeout`` while its connection stayed up (a down one is :meth:`dead`'s
        to judge): long enough for TCP to take a partitioned backup's connection down."""
        return (self.waiting_since is not None and self.down_since is None
                and now - self.waiting_since > timeout + max(timeout, SILENCE))

    def read(self) -> wrepl.Ack | None:
        """One acknowledgement if one is waiting, sealed by a replica of our shard (a
        refusal of our seal is kept in :attr:`mismatch`; anything else is dropped)."""
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            try:
                record, _ = wrepl.decode(frames)
                if isinstance(record, wrepl.Refusal):
                    self.mismatch = (f"it refuses this replica's messages: {record.reason} "
                                     f"(its replication key {record.key_id}, ours "
                                     f"{self.key.key_id})")
                    continue
                self.key.open(frames)
            except ProtocolError:
                continue  # (only the backup's own socket answers here)
            if isinstance(record, wrepl.Ack):
                return record

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(0)
        self.socket.close(0)

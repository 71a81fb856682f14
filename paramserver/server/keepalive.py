"""The primary's keep-alives to its backups, sent from a thread of their own (issue 32).

A backup takes over once its primary has been silent for the failover timeout. Were
the keep-alives sent from the shard's loop, a primary busy in one handler for longer
than that (a 100 MiB push being applied, a snapshot being copied) would be taken for
dead: the backup would take over beside a live primary, which is safe (fencing) but
costs a takeover and a rejoin. A thread sends them instead, on sockets of its own, so
the timeout need only cover a dead or frozen process (SIGKILL, SIGSTOP, a lost host:
every thread stops) and can be short.

A primary whose loop is stuck for good must still be replaced: the loop renews a
lease at each of its turns (:meth:`KeepAlive.aim`) and the thread sends nothing once
the lease is older than :data:`MAX_BUSY`. A backup that refuses a keep-alive names a
higher epoch: the thread keeps it for the loop (:meth:`KeepAlive.refusal`), which
steps down as when an input is refused.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import zmq

from paramserver.errors import ProtocolError
from paramserver.wire import replication as wrepl
from paramserver.wire.curve import CurveKeys, secure_client
from paramserver.wire.replauth import ReplicationKey

__all__ = ["MAX_BUSY", "KeepAlive"]

log = logging.getLogger(__name__)

#: seconds the shard's loop may spend in one turn before its keep-alives stop (a loop
#: stuck that long is taken for hung, and its backup takes over)
MAX_BUSY = 30.0
#: keep-alives queued per backup at most (more add nothing: one is enough)
_QUEUE = 4


class KeepAlive:
    """Keep-alives every ``every`` seconds to the addresses the loop aims them at."""

    def __init__(self, context: zmq.Context[Any], every: float, shard: int,
                 key: ReplicationKey, curve: CurveKeys | None = None) -> None:
        self._context = context
        self._key = key  # (this thread's own: its replay windows are its own)
        self._curve = curve  # under CURVE: the shard's own keys, as the backups require
        self._every = every
        self._shard = shard
        self._lock = threading.Lock()
        self._epoch = 0
        self._targets: tuple[str, ...] = ()
        self._peers: list[str] = []
        self._lease = time.monotonic()
        self._refusal: tuple[int, str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def aim(self, epoch: int, addresses: tuple[str, ...], now: float,
            peers: list[str] | None = None) -> None:
        """Send keep-alives of ``epoch`` to ``addresses`` (none: stop), listing ``peers``
        (the primary and its backups), and renew the lease: the loop is turning at
        ``now``."""
        with self._lock:
            self._epoch, self._targets, self._lease = epoch, addresses, now
            self._peers = peers or []
        if addresses and self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"shard{self._shard}-keepalive")
            self._thread.start()

    def renew(self, now: float) -> None:
        """The loop is turning (inside a long wait for a backup, say)."""
        with self._lock:
            self._lease = now

    def refusal(self) -> tuple[int, str] | None:
        """(epoch, address) of a backup that refused a keep-alive naming a higher epoch
        than ours, once; None if none did."""
        with self._lock:
            found, self._refusal = self._refusal, None
        return found

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def _run(self) -> None:
        sockets: dict[str, zmq.Socket[Any]] = {}
        try:
            while not self._stop.wait(self._every):
                with self._lock:
                    epoch, targets, lease = self._epoch, self._targets, self._lease
                    peers = self._peers
                now = time.monotonic()
                for address in [a for a in sockets if a not in targets]:
                    sockets.pop(address).close(0)
                if now - lease > MAX_BUSY:
                    continue  # the loop is stuck: let the backups take over
                for address in targets:
                    # one seal per backup: a keep-alive captured on its way to one is
                    # not one the other has yet to take
                    head = self._key.seal(wrepl.encode(wrepl.Apply(epoch, 0, now, "ping",
                                                                   peers=peers)))
                    sock = sockets.get(address) or self._connect(sockets, address)
                    self._read(sock, address, epoch)
                    # (not connected yet, or its queue is full: it has pings enough)
                    with contextlib.suppress(zmq.Again):
                        sock.send_multipart(head, zmq.NOBLOCK)
        except Exception:  # (a bug here must show; the loop goes on, unpinged)
            log.exception("shard %d: the keep-alive thread stopped", self._shard)
        finally:
            for sock in sockets.values():
                sock.close(0)

    def _connect(self, sockets: dict[str, zmq.Socket[Any]], address: str) -> zmq.Socket[Any]:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _QUEUE)
        if self._curve is not None:
            secure_client(sock, self._curve)
        sock.connect(address)
        sockets[address] = sock
        return sock

    def _read(self, sock: zmq.Socket[Any], address: str, epoch: int) -> None:
        """The backup's answers to earlier keep-alives: only a refusal matters."""
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                record, _ = wrepl.decode(frames)
                if isinstance(record, wrepl.Refusal):
                    log.error("shard %d: backup %s refuses this replica's keep-alives: %s "
                              "(its replication key %s, ours %s)", self._shard, address,
                              record.reason, record.key_id, self._key.key_id)
                    continue
                self._key.open(frames)
            except ProtocolError as exc:
                log.warning("shard %d: a bad answer to a keep-alive from %s: %s",
                            self._shard, address, exc)
                continue
            if isinstance(record, wrepl.Ack) and not record.ok and record.epoch > epoch:
                with self._lock:
                    self._refusal = (record.epoch, address)

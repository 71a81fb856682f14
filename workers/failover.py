"""A worker's side of replicated shards: find the primary, move to it, resend.

A shard with backups (``paramserver launch --replicas 1``) is given to workers as its
replicas' addresses joined by ``|``, the primary first
(``tcp://127.0.0.1:5001|tcp://127.0.0.1:5002``; shards still separated by commas).
A request that goes unanswered for an attempt asks every replica of its shard which
role it holds (paramserver/wire/replication.py, :class:`~paramserver.wire.replication.
WhoIs`); if the primary of the highest epoch is not the one the request went to, the
shard's channel and heartbeat move to it and the request goes again, as it was:
same push id, so a push the old primary forwarded before it died is not applied twice
(the push-id windows are part of the replicated state).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from paramserver.errors import RequestTimeoutError
from paramserver.wire import replication as wrepl
from paramserver.wire.curve import CurveKeys, secure_client
from paramserver.wire.transport import Channel, SideChannel
from paramserver.workers.liveness import Heartbeat, Patience, Waiter

__all__ = ["POLL_EVERY", "RESEND_EVERY", "SEPARATOR", "TAKEOVER_WAIT", "Failover",
           "FailoverHeartbeat", "FailoverPatience", "FollowOnly", "ask_roles",
           "current_primaries", "join_replicas", "move", "primary_of"]

log = logging.getLogger(__name__)

#: between the replicas of one shard in an address list
SEPARATOR = "|"
#: how long a replica has to say which role it holds
PROBE_TIMEOUT = 0.3
#: a request to a replicated shard is judged (and maybe moved) this often at most
ATTEMPT_TIMEOUT = 1.0
#: while no replica says it is primary (the primary fell silent and its backup has not
#: taken over yet), the replicas are asked again this often, up to TAKEOVER_WAIT:
#: a worker reaches the new primary within about this much of its takeover, not at
#: its next attempt
POLL_EVERY = 0.05
TAKEOVER_WAIT = 5.0
#: a request unanswered by a primary that is still primary is sent to it again only
#: this often (a plain client's default attempt timeout): a large push that takes
#: over an attempt is being handled, and sending it again every attempt made the
#: primary forward every copy to its backups (a 100 MiB push, once a second)
RESEND_EVERY = 5.0


def join_replicas(replicas: Sequence[str]) -> str:
    """One shard's entry in an address list: its replicas, the primary first."""
    return SEPARATOR.join(replicas)


def ask_roles(addresses: Sequence[str], timeout: float = PROBE_TIMEOUT,
              enough: Callable[[dict[str, wrepl.RoleReply | None]], bool] | None = None,
              curve: CurveKeys | None = None) -> dict[str, wrepl.RoleReply | None]:
    """Each replica's answer to WhoIs (None: no answer within ``timeout``), asked at once;
    with ``enough``, only until it holds of the answers so far (a dead replica never
    answers: without it every probe of a shard that lost one lasts ``timeout``).
    ``curve``: the client keys a CURVE shard admits."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    socks: dict[str, zmq.Socket[Any]] = {}
    out: dict[str, wrepl.RoleReply | None] = dict.fromkeys(addresses)
    poller = zmq.Poller()
    try:
        for a in addresses:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                secure_client(s, curve)
            s.connect(a if "://" in a else f"tcp://{a}")
            s.send_multipart(wrepl.encode(wrepl.WhoIs()), zmq.NOBLOCK)
            socks[a] = s
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        waiting = set(addresses)
        while waiting and (left := deadline - time.monotonic()) > 0:
            for sock, _ in poller.poll(max(1, int(left * 1000))):
                address = next(a for a, s in socks.items() if s is sock)
                try:
                    record, _ = wrepl.decode(sock.recv_multipart(zmq.NOBLOCK))
                except Exception as exc:  # a replica that says nonsense counts as silent
                    log.debug("role of %s: %s", address, exc)
                    continue
                if isinstance(record, wrepl.RoleReply):
                    out[address] = record
                waiting.discard(address)
            if enough is not None and enough(out):
                break
    except zmq.ZMQError as exc:
        log.debug("asking replicas their roles: %s", exc)
    finally:
        for s in socks.values():
            s.close(0)
    return out


def primary_of(roles: dict[str, wrepl.RoleReply | None]) -> tuple[str, int] | None:
    """The address and epoch of the primary of the highest epoch (None: none says so)."""
    primaries = [(r.epoch, a) for a, r in roles.items() if r is not None and r.role == "primary"]
    if not primaries:
        return None
    epoch, address = max(primaries)
    return address, epoch


def current_primaries(entries: Sequence[str], timeout: float = 5.0,
                      curve: CurveKeys | None = None) -> list[str]:
    """The address of each shard's primary now (``entries``: an address list's items,
    replicas joined by ``|``); a shard given by one address is that address. Waits up
    to ``timeout`` for a takeover under way."""
    out = []
    for entry in entries:
        replicas = entry.split(SEPARATOR)
        found = None
        deadline = time.monotonic() + timeout
        while len(replicas) > 1 and found is None:
            found = primary_of(ask_roles(replicas, curve=curve))
            if found is None and time.monotonic() > deadline:
                break
        out.append(found[0] if found else replicas[0])
    return out


def move(channel: Channel[Any], address: str) -> None:
    """Point ``channel`` at ``address`` (the same socket: a request waiting on it goes on)."""
    if channel.address == address:
        return
    with contextlib.suppress(zmq.ZMQError):  # (not connected any more)
        channel.socket.disconnect(channel.address)
    channel.socket.connect(address)
    channel.address = address


class Failover:
    """One client's replica sets, and where each shard's requests go now."""

    def __init__(self, replicas: list[list[str]], curve: CurveKeys | None = None) -> None:
        self.replicas = replicas
        self.curve = curve  # the client's keys, to ask a CURVE shard's replicas
        #: each shard's current primary; the heartbeat thread follows this list
        self.targets = [r[0] for r in replicas]
        self.moves = 0

    @classmethod
    def of(cls, entries: Sequence[str], curve: CurveKeys | None = None) -> Failover | None:
        """From an address list; None when no shard has replicas."""
        replicas = [[a if "://" in a else f"tcp://{a}" for a in e.split(SEPARATOR) if a]
                    for e in entries]
        return cls(replicas, curve) if any(len(r) > 1 for r in replicas) else None

    @property
    def primaries(self) -> list[str]:
        return list(self.targets)

    def heartbeat(self, worker: int, interval: float, curve: CurveKeys | None,
                  run_id: str | None = None) -> FailoverHeartbeat:
        return FailoverHeartbeat(self.targets, worker, interval, curve, run_id)

    def patience(self, client: Waiter, heartbeat: Heartbeat | None, label: str,
                 shards: Sequence[int], started: float | None = None
                 ) -> Callable[[list[int]], bool]:
        """What judges a request that is taking long (``heartbeat`` None: before the
        heartbeats start, or an observer's): it moves a shard to its new primary.
        ``started``: when the request began (default: now)."""
        if heartbeat is None:
            return FollowOnly(self, client, label, shards, started)
        return FailoverPatience(self, client, heartbeat, label, shards, started)

    def follow(self, client: Waiter, shard: int, wait: float = TAKEOVER_WAIT) -> bool:
        """Ask ``shard``'s replicas who is primary; move there if it is not where our
        requests go. Returns whether the channel moved.

        While none says it is primary, asks again every POLL_EVERY for up to ``wait``
        seconds, or until a reply to us arrives: a takeover under way is followed as
        it happens. Moving is always safe, whatever we are told: a primary that was
        superseded is fenced at its next forward and answers no one, so a worker
        misled to it only asks again; and a request sent again keeps its push id."""
        if len(self.replicas[shard]) < 2:
            return False
        channel = client.channels[shard]
        deadline = time.monotonic() + wait

        def claimed(roles: dict[str, wrepl.RoleReply | None]) -> bool:
            return primary_of(roles) is not None

        # asked until one says it is primary: the silent one is not waited for
        found = primary_of(ask_roles(self.replicas[shard], enough=claimed, curve=self.curve))
        while found is None and time.monotonic() < deadline:
            if zmq.select([channel.socket], [], [], POLL_EVERY)[0]:
                return False  # the primary answered us after all
            found = primary_of(ask_roles(self.replicas[shard], POLL_EVERY * 2, claimed,
                                         self.curve))
        if found is None or found[0] == channel.address:
            return False
        address, epoch = found
        log.warning("shard %d: its primary is now %s (epoch %d), not %s: moving there and "
                    "sending the requests in flight again", shard, address, epoch,
                    channel.address)
        move(channel, address)
        self.targets[shard] = address
        self.moves += 1
        return True


class FailoverPatience(Patience):
    """:class:`Patience`, which first moves a shard that answers nothing to its new
    primary, and then sends the request again at once."""

    def __init__(self, failover: Failover, client: Waiter, heartbeat: Heartbeat, label: str,
                 shards: Sequence[int], started: float | None = None) -> None:
        super().__init__(client, heartbeat, label, shards, started)
        self.failover = failover
        self.judged = self.started  # when Patience last judged (and maybe resent)

    def __call__(self, lost: list[int]) -> bool:
        moved = False
        for shard in sorted({self.shards[i] for i in lost}):
            if self.failover.follow(self.client, shard):
                moved = True
                self.last_held.pop(shard, None)
                # the new primary's heartbeat answers count from now
                self.heartbeat.last_reply[shard] = time.monotonic()
        if moved:
            return True
        now = time.monotonic()
        if now - self.judged < RESEND_EVERY:
            return False  # still where it was sent: keep waiting for its answer
        self.judged = now
        return super().__call__(lost)


class FollowOnly:
    """Without heartbeats (a HELLO, an observer): move a shard that answers nothing to
    its new primary and send again; give up after the client's ``timeout``."""

    def __init__(self, failover: Failover, client: Waiter, label: str,
                 shards: Sequence[int], started: float | None = None) -> None:
        self.failover, self.client, self.label, self.shards = failover, client, label, shards
        self.started = time.monotonic() if started is None else started

    def __call__(self, lost: list[int]) -> bool:
        shards = sorted({self.shards[i] for i in lost})
        for shard in shards:
            self.failover.follow(self.client, shard)
        if time.monotonic() - self.started > self.client.timeout:
            where = ", ".join(f"shard {s} at {self.client.channels[s].address}" for s in shards)
            raise RequestTimeoutError(f"{self.label}: no reply within "
                                      f"{self.client.timeout:g}s from {where}")
        return True


class FailoverHeartbeat(Heartbeat):
    """:class:`Heartbeat` to each shard's current primary (``addresses`` is the
    :attr:`Failover.targets` list, which a move updates)."""

    def _prepare(self, shard: int, channel: Channel[SideChannel]) -> None:
        move(channel, self.addresses[shard])  # to the shard's primary of now

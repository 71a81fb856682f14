"""A shard's replicas: the primary forwards its inputs, backups apply them, and a
backup takes over when the primary falls silent (issue 32).

What is replicated are the *inputs*, not the results: each data message that can
change the shard's state (HELLO, INIT, PUSH, PULL, HEARTBEAT, BYE), as the primary
received it, plus the deaths and leave-outs its timers decide. The shard's rules are
a deterministic state machine (paramserver/core/shard.py, sync rounds reduced in a
fixed order), so a backup that handles the same inputs in the same order through
the same code holds the same weights, optimizer state, versions, clocks and push-id
windows. Inputs rather than results because a result (the new weights) is as large
as the model at every async push, while the input is the push itself; in sync the
inputs are the round's pushes, which cost the same bytes as a round's result times
the workers but need no second code path (docs/reliability.md has the figures).

The primary sends an input to its backups before it handles it, and sends the
worker its answer only once every backup acknowledged it: an answered push is held
by every live replica. A backup whose connection has been down for the failover
timeout, and whose host refuses its port (a dead process, not a partition:
paramserver/server/peerprobe.py), is dropped (the shard goes on with fewer replicas,
and says so). Keep-alives go out from a thread (paramserver/server/keepalive.py).

Fencing: each replica holds an epoch (paramserver/core/replica.py). A promoted backup
takes the next one and refuses any input of a lower one; a paused primary that comes
back is refused at its first forward (or keep-alive) and steps down: it answers no
worker again, and rejoins as a backup of the new primary.

Joining (paramserver/server/rejoin.py): a fenced old primary, or a process started in
place of a dead replica (given peers, and for replica 0 `replacement`), asks its
peers for the primary's state. A primary waiting on a backup that reconnects sends it
again what it has not acknowledged: the same process applies what it lacks, a new
process at a dead one's address refuses inputs of a primary it holds no state of, and
is dropped, then joins. The primary sends it a snapshot at its last input, then
forwards to it as to any backup, and counts it as holding an input only once it
acknowledged the snapshot.

Trust (issue 42): a replica takes every replication message but the role probe only
from another replica of its shard, sealed with the run's replication key, once
(paramserver/server/replgate.py). Inputs travel, under CURVE, encrypted, each with
the key its worker sent it with, so that a backup checks and binds worker ids by it
as the primary did.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from paramserver.core.replica import (
    Candidate,
    ReplicaState,
    Role,
    Takeover,
    Verdict,
    elect,
    snapshot_fault,
)
from paramserver.errors import ConfigError, ProtocolError
from paramserver.observe import records as ev
from paramserver.server.backuplink import BackupLink
from paramserver.server.forwarded import owned as _owned
from paramserver.server.keepalive import KeepAlive
from paramserver.server.rejoin import Joiner
from paramserver.server.replgate import Gate
from paramserver.server.replhost import ReplicationHost
from paramserver.server.takeover import Election
from paramserver.wire import replication as wrepl
from paramserver.wire.curve import CurveKeys
from paramserver.wire.protocol import Op

if TYPE_CHECKING:

    from paramserver.observe.events import EventLog
    from paramserver.observe.metrics import MetricsRegistry
    from paramserver.server.config import ServerConfig

__all__ = ["REPLAYED", "REPLICATED_OPS", "Replication", "ReplicationHost"]

log = logging.getLogger(__name__)

#: the identity a backup handles forwarded messages under: no peer has it, so the
#: answers it sends to it go nowhere (the ROUTER drops them)
REPLAYED = b"\x00replayed"
#: how a replica answers on the shard's socket: (peer identity, frames)
Send = Callable[[bytes, list[bytes]], None]
#: the data ops whose messages the primary forwards (the others change nothing)
REPLICATED_OPS = frozenset({Op.HELLO, Op.INIT, Op.PUSH, Op.PULL, Op.HEARTBEAT, Op.BYE})


class Replication:
    """One replica's side of its shard's replication (primary or backup)."""

    #: seconds between two exports of the replication gauges
    EXPORT_EVERY = 0.5

    def __init__(self, host: ReplicationHost, config: ServerConfig, events: EventLog,
                 address: str) -> None:
        if config.replica == 0 and not config.replica_peers:
            raise ConfigError("--replicas: replica 0 (the shard's first primary) needs "
                              "--replica-peers with its backups' addresses")
        self.host = host
        self.shard = config.shard
        self.replica = config.replica
        self.events = events
        self.address = address
        self.timeout = config.failover_timeout
        self.ping_every = self.timeout / 5
        self.state = ReplicaState.starting(config.replica, config.replicas + 1,
                                           config.replacement)
        #: the primary and its backups, as its keep-alives list them (a backup asks
        #: them who takes over when the primary falls silent)
        self.peers: list[str] = []
        #: a new primary's backups that must hold its snapshot before it answers a
        #: worker (those it found alive when it took over), by address
        self._settle: set[str] = set()
        self._election: Election | None = None  # a silent primary's: who takes over
        self._context: zmq.Context[Any] = zmq.Context.instance()
        # CURVE: the shard's own keys, as a client of the other replicas; and the only
        # key a replication message other than a role probe is taken from
        self.curve = (CurveKeys.load(config.curve_secret_key).as_replica()
                      if config.curve_secret_key else None)
        # who we take replication messages from, and what ours are sealed with
        self.gate = Gate(config, self.curve, events, address)
        self.key = self.gate.key
        self.given = list(config.replica_peers)  # the replicas it is started with
        self.backups: list[BackupLink] = []
        # keep-alives from a thread: a primary busy in one handler is not taken for dead
        # (its own replay windows: the thread reads its answers itself)
        self.keepalive = KeepAlive(self._context, self.ping_every, self.shard,
                                   self.key.reader(), self.curve)
        self.failovers = 0
        self.lost: list[str] = []  # backups dropped for silence
        self._exported_at = float("-inf")
        #: joining backups: sent their snapshot at that input, not acknowledged yet
        #: (the primary waits for no input of theirs meanwhile)
        self._joining: dict[BackupLink, int] = {}
        #: joining replicas to send a snapshot to at the next quiet moment: address ->
        #: their request's nonce; and the nonce each backup joined with, by address
        self._asked: OrderedDict[str, str] = OrderedDict()
        self._asked_at: dict[str, float] = {}  # when each one asked, by address
        self._nonces: dict[str, str] = {}
        self.joiner: Joiner | None = None
        self._asked_since: float | None = None

    def start(self) -> None:
        """Reach the replicas it was given (the constructor does no I/O). Replica 0
        starts as the primary of the backups it is given and announces itself to each
        (waiting for them); a replica given peers otherwise was started in place of a
        dead one, and joins (replica 0 too: announcing itself as primary to the live
        one would wait on it as it waits)."""
        if self.state.writable:
            self.backups = [self._link(a) for a in self.given]
        if self.backups:
            self._announce()
            self._aim(time.monotonic())
        elif self.given:
            self._rejoin(self.given)

    # ------------------------------------------------------------------ primary

    @property
    def writable(self) -> bool:
        """Whether this replica answers workers: the primary, once each backup it took
        over with holds its snapshot (a rival that promoted too refuses it first)."""
        if self._settle:
            self._settle &= set(self._asked) | {b.address for b in self._joining}
        return self.state.writable and not self._settle

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this replica writes the shard's checkpoints (ReplicaState's rule;
        a joining backup is not counted yet; a backup's rank is its place among the
        backups the primary's keep-alives list)."""
        backups = self.peers[1:]
        return self.state.writes_checkpoints(
            sum(1 for b in self.backups if b not in self._joining),
            backups.index(self.address) if self.address in backups else None)

    def forward(self, frames: Sequence[Any], kind: str = "msg",
                workers: Sequence[int] = (), key: str | None = None) -> int:
        """Send one input to every backup (not waiting); its sequence number (0: no
        backup to send it to). ``key``: the CURVE key the message came with."""
        if not self.backups:
            return 0
        now = time.monotonic()
        seq = self.state.next_seq()
        # one seal for every backup (each takes it once): its MAC reads the input once
        sealed = self.key.seal([*wrepl.encode(wrepl.Apply(
            self.state.epoch, seq, now, kind, list(workers), key)), *frames])  # type: ignore[arg-type]
        owned: list[Any] | None = None
        for b in list(self.backups):
            if b in self._joining:  # not waited for (wait): its own copy of what may
                owned = owned or _owned(frames)  # lie in a worker's segment (as_tcp)
            sent = [*sealed[:3], *owned] if b in self._joining and owned else sealed
            b.pending[seq] = sent
            b.sent(now)
            self._deliver(b, sent)
        return seq

    def _link(self, address: str) -> BackupLink:
        self.gate.members.add(address)
        return BackupLink(address, self._context, self.key, self.timeout, self.curve)

    def _mismatched(self, b: BackupLink, starting: bool = False) -> bool:
        """Whether ``b`` refuses us for a key or version of another (then dropped, said
        loudly; at the start, the shard does not start: ConfigError)."""
        if b.mismatch is None:
            return False
        why = self.gate.mismatch(b.address, b.mismatch)
        if starting:
            raise ConfigError(why)
        log.error("%s", why)
        self._drop(b, "a key or version mismatch")
        return True

    def _deliver(self, b: BackupLink, frames: list[Any]) -> None:
        """Send ``frames`` to ``b``, waiting while it is alive (dropped once dead)."""
        while not b.send(frames):
            self.keepalive.renew(time.monotonic())
            if b.dead(time.monotonic(), self.timeout):
                self._drop(b, f"its connection was down for {self.timeout:g}s")
                return
            if self._mismatched(b):
                return

    def _announce(self) -> None:
        """Before the primary serves, each backup hears of it (and so takes over should
        it die from its first message on)."""
        for b in list(self.backups):
            if b not in self.backups:
                continue  # (fenced by an earlier one: _rejoin closed it)
            self._deliver(b, self.key.seal(wrepl.encode(wrepl.Apply(
                self.state.epoch, 0, time.monotonic(), "ping", peers=self._peer_list()))))
            while b in self.backups and not self._drain(b):
                self._mismatched(b, starting=True)  # (a shard that cannot start says why)
                if b.dead(time.monotonic(), self.timeout):
                    self._drop(b, f"it did not answer within {self.timeout:g}s of the start")
                    break
                zmq.select([b.socket, b.monitor], [], [], 0.1)

    def wait(self, seq: int) -> bool:
        """Wait until every backup acknowledged ``seq``; False when a backup refused it
        naming a higher epoch (this replica is fenced now and must answer no one)."""
        if not seq:
            return self.writable
        for b in list(self.backups):
            since = time.monotonic()
            while b.acked < seq and b in self.backups and b not in self._joining:
                got = self._drain(b)
                if not self.writable or self._refused_ping():
                    return False  # fenced
                if got:
                    continue
                now = time.monotonic()
                self.keepalive.renew(now)  # waiting on a backup is not being stuck
                if b.dead(now, self.timeout):
                    self._drop(b, f"its connection was down for {self.timeout:g}s")
                elif self._mismatched(b):
                    pass
                elif b.reconnected:  # the same backup gets again what it lacks; a new
                    b.reconnected = False  # process at its address refuses it (on_message)
                    since = now
                    for sent in list(b.pending.values()):
                        self._deliver(b, sent)
                elif b.silent(now, self.timeout):
                    self._drop(b, self._silence(b, now))
                elif now - since > self.timeout:
                    since = now
                    log.warning("shard %d: backup %s has not acknowledged input %d yet; "
                                "waiting (its connection is %s)", self.shard, b.address, seq,
                                "down: it may be taking over" if b.down_since is not None
                                else "up")
                zmq.select([b.socket, b.monitor], [], [], 0.1)
        return self.writable

    def _drain(self, b: BackupLink) -> bool:
        """Read every acknowledgement waiting from ``b``; whether there was one."""
        got = False
        while (ack := b.read()) is not None:
            got = True
            if ack.ok:
                b.acknowledged(ack.seq, time.monotonic())
                if b in self._joining:
                    self._joined(b)
            elif self.state.refused(ack.epoch):
                self._fenced(ack.epoch, b.address)
                return True
            else:
                log.error("shard %d: backup %s refused input %d: %s", self.shard, b.address,
                          ack.seq, ack.reason)
                self._drop(b, ack.reason or "refused")
                return True
        return got

    def _silence(self, b: BackupLink, now: float) -> str:
        """Why a backup whose connection is up but which acknowledges nothing is dropped:
        it holds every worker's answer (it asks to join again once it wakes up)."""
        return (f"it acknowledged nothing for {now - (b.waiting_since or now):.1f}s while "
                f"its connection was up (paused or stuck, not cut off); workers are "
                f"answered without it")

    def _drop(self, b: BackupLink, why: str) -> None:
        if b not in self.backups:
            return
        self.backups.remove(b)
        self._joining.pop(b, None)
        b.close()
        self.lost.append(b.address)
        log.warning("shard %d: backup %s dropped (%s); the shard goes on with %d backup(s)",
                    self.shard, b.address, why, len(self.backups))
        self.events.write(ev.BackupLost(shard=self.shard, backup=b.address, reason=why,
                                        epoch=self.state.epoch, backups=len(self.backups)))
        self.events.flush()  # (the worker it held is answered next: said before that)

    def _fenced(self, epoch: int, by: str) -> None:
        log.warning("shard %d: replica %d steps down: %s holds epoch %d (ours was older); "
                    "it accepts nothing from now on, and rejoins as a backup", self.shard,
                    self.replica, by, epoch)
        self.events.write(ev.SteppedDown(shard=self.shard, replica=self.replica, epoch=epoch,
                                         by=by))
        self._rejoin([by, *(b.address for b in self.backups if b.address != by)])

    # ------------------------------------------------------------------ joining

    def _rejoin(self, peers: list[str]) -> None:
        """Hold no state of our own any more: ask ``peers`` for the primary's."""
        for b in self.backups:
            b.close()
        self.backups, self._joining, self._settle = [], {}, set()
        if self._election is not None:
            self._election.close()
            self._election = None
        self.state.rejoin()
        self.keepalive.aim(self.state.epoch, (), time.monotonic())  # no primary's words
        self._asked_since = time.monotonic()
        if self.joiner is not None:
            self.joiner.close()
        self.joiner = Joiner(peers, self.address, self.replica, self._context, self.key,
                             self.curve)
        log.info("shard %d: replica %d joins as a backup: asking %s for the primary's "
                 "state", self.shard, self.replica, ", ".join(peers))

    def _on_join(self, record: wrepl.Join, sender: int) -> None:
        """A replica asks for our state. The primary sends it at the next quiet moment;
        a resend of a request it has is ignored, a new process at a known backup's
        address replaces that backup. Only a replica of the shard's set asks, for its
        own index and an address of the set (the seal told who sealed it)."""
        if not self.gate.joins(record, sender):
            return
        if not self.state.writable or self._nonces.get(record.address) == record.nonce \
                or self._asked.get(record.address) == record.nonce:
            return
        if record.address in self._settle:  # the takeover's snapshot answers it
            self._nonces[record.address] = record.nonce
            if record.address in self._asked:
                self._asked[record.address] = record.nonce
            return
        for b in [b for b in self.backups if b.address == record.address]:
            self._drop(b, "a new process joins at its address")
        self._asked[record.address] = record.nonce
        self._asked_at[record.address] = time.monotonic()
        self._send_snapshots()

    def _send_snapshots(self) -> None:
        """A snapshot to each replica that asked, if the shard is between inputs."""
        if not self._asked or not self.state.writable:
            return
        image = self.host.send_state()
        if image is None:
            return  # a push or INIT in parts is under way: the next tick tries again
        seq = self.state.applied
        frames = self.key.seal(wrepl.snapshot_frames(
            self.state.epoch, seq, time.monotonic(), self.address, image.plan, image.core,
            image.tensors, image.owners, image.optimizer))
        size = sum(t.numel() * t.element_size() for t in image.tensors.values())
        while self._asked:
            address, nonce = self._asked.popitem(last=False)
            b = self._link(address)
            self.backups.append(b)
            self._joining[b] = seq
            self._nonces[address] = nonce
            self._deliver(b, frames)
            if b in self.backups:
                log.info("shard %d: sent replica at %s a snapshot at input %d (%d bytes of "
                         "tensors); it joins as a backup", self.shard, address, seq, size)
                self.events.write(ev.BackupJoining(shard=self.shard, backup=address, seq=seq,
                                                   epoch=self.state.epoch, bytes=size))

    def _joined(self, b: BackupLink) -> None:
        """``b`` acknowledged its snapshot. The inputs forwarded to it meanwhile were
        answered without it: wait until it holds them too, then count it as a backup
        (so that every input answered from then on, and before, is held by it)."""
        seq = self._joining.pop(b)
        target = self.state.applied
        while b in self.backups and b.acked < target and self.state.writable:
            if self._drain(b):
                continue
            now = time.monotonic()
            if b.dead(now, self.timeout):
                self._drop(b, f"its connection was down for {self.timeout:g}s")
            elif b.silent(now, self.timeout):
                self._drop(b, self._silence(b, now))
            elif not self._mismatched(b):
                zmq.select([b.socket, b.monitor], [], [], 0.1)
        if b not in self.backups or not self.state.writable:
            return
        took = time.monotonic() - self._asked_at.pop(b.address, time.monotonic())
        log.info("shard %d: %s holds the snapshot at input %d and every input since: a "
                 "backup from now on, %.2fs after it asked", self.shard, b.address, seq, took)
        self.events.write(ev.BackupJoined(shard=self.shard, backup=b.address, seq=seq,
                                          epoch=self.state.epoch, backups=len(self.backups),
                                          primary=self.address, seconds=round(took, 3)))
        self.events.flush()  # (the launcher tells of it: not left in a buffer)

    def _on_snapshot(self, identity: bytes, record: wrepl.Snapshot, rest: list[Any],
                     send: Send) -> None:
        """The primary's state: put in place of ours, then a backup from input ``seq``.
        Also what a new primary sends the backups it took over with (whatever inputs
        they hold beyond its own go), and a rival promoted at a lower epoch (it steps
        down); a snapshot of a lower epoch is refused, which fences its sender."""
        if not self.state.takes_snapshot(record.epoch, record.seq):
            self.gate.refusal(f"a snapshot of epoch {record.epoch} at input {record.seq} from "
                          f"{record.primary}: older than this replica's state (epoch "
                          f"{self.state.epoch}, input {self.state.applied})")
            if record.epoch < self.state.epoch:
                send(identity, self.key.seal(wrepl.encode(wrepl.Ack(
                    self.state.epoch, record.seq, False, "a lower epoch"))))
            return  # (else an older one, sent before the one in place)
        try:
            theirs = msgspec.json.decode(record.plan) if record.plan else None
        except msgspec.DecodeError:
            theirs = "(unreadable)"
        fault = snapshot_fault(self.host.plan_description(), theirs, record.core is not None)
        if fault is not None:
            self.gate.refusal(f"a snapshot of epoch {record.epoch} at input {record.seq} from "
                          f"{record.primary}: {fault}")
            return
        if self.state.role is Role.PRIMARY:  # a rival of a lower epoch, not serving yet
            log.warning("shard %d: replica %d steps down: %s took over at epoch %d",
                        self.shard, self.replica, record.primary, record.epoch)
            self.events.write(ev.SteppedDown(shard=self.shard, replica=self.replica,
                                             epoch=record.epoch, by=record.primary))
            for b in self.backups:
                b.close()
            self.backups, self._joining, self._settle = [], {}, set()
            self._asked.clear()
            self.keepalive.aim(self.state.epoch, (), time.monotonic())
        try:
            self.host.restore(record, rest)
        except (ConfigError, ProtocolError) as exc:  # checked as a resume checks a checkpoint
            log.error("shard %d: the primary's snapshot at input %d is refused: %s; asking "
                      "again", self.shard, record.seq, exc)
            if self.joiner is not None:
                self.joiner.renew()
            return
        now = time.monotonic()
        self.state.joined(record.epoch, record.seq, now)
        if self.joiner is not None:
            self.joiner.close()
            self.joiner = None
        send(identity, self.key.seal(wrepl.encode(wrepl.Ack(self.state.epoch, record.seq,
                                                             True))))
        took = now - (self._asked_since or now)
        log.warning("shard %d: replica %d (%s) rejoined as a backup of %s at epoch %d, "
                    "input %d, %.2fs after it asked", self.shard, self.replica, self.address,
                    record.primary, record.epoch, record.seq, took)
        self.events.write(ev.Rejoined(shard=self.shard, replica=self.replica, address=self.address,
                                      primary=record.primary, epoch=record.epoch, seq=record.seq,
                                      seconds=round(took, 3)))
        self.events.flush()  # (the launcher acts on it: not left in a buffer)

    # ------------------------------------------------------------------ both

    def tick(self, now: float) -> None:
        """Keep-alives and acknowledgements, snapshots to joining replicas (primary); a
        takeover when the primary fell silent (backup); requests to join (joining)."""
        if self.joiner is not None:
            self.joiner.tick(now)
        if self.state.role is Role.PRIMARY:
            if self._refused_ping():
                return
            self._send_snapshots()
            for b in list(self.backups):
                self._drain(b)
                if b not in self.backups or self._mismatched(b):
                    continue
                if b.dead(now, self.timeout):
                    self._drop(b, f"its connection was down for {self.timeout:g}s")
                elif b.silent(now, self.timeout) and b not in self._joining:
                    self._drop(b, self._silence(b, now))
            self._aim(now)
            return
        if self._election is not None:
            found = self._election.poll(now)
            if found is not None:
                self._election.close()
                self._election = None
                if self.state.silent(now, self.timeout):  # (else heard meanwhile)
                    self._elect(now, found)
        elif self.state.silent(now, self.timeout):
            others = self._rivals()
            if others:  # their answers come in while the loop turns (takeover.py)
                self._election = Election(others, now, min(self.timeout / 2, 0.3),
                                          self.curve)
            else:
                self._take_over(now)

    def _rivals(self) -> list[str]:
        """The replicas a backup asks when its primary fell silent: the primary too (it
        may be alive and have dropped us: elect), then the other backups."""
        return [a for a in self.peers if a != self.address]

    def _elect(self, now: float, found: dict[str, Candidate]) -> None:
        """The primary fell silent and the other replicas it listed said what they
        hold (``found``, those that answered): take over, wait or join a newer primary
        as :func:`elect` decides."""
        decision = elect(self.state.candidate(), list(found.values()), self.address)
        if decision is Takeover.PROMOTE:
            self._take_over(now, [a for a, c in found.items() if c.role is Role.BACKUP])
        elif decision is Takeover.FOLLOW:
            newer = [a for a, c in found.items() if c.epoch > self.state.epoch
                     or c.role is Role.PRIMARY]
            if not any(c.epoch > self.state.epoch for c in found.values()):
                log.warning("shard %d: replica %d (%s) was dropped by its primary %s, which "
                            "answers workers without it; it joins again", self.shard,
                            self.replica, self.address, ", ".join(newer))
            self._rejoin([*newer, *(a for a in self._rivals() if a not in newer)])
        else:  # asked again in half a timeout: the winner may have died meanwhile
            log.info("shard %d: replica %d waits: %s", self.shard, self.replica,
                     ", ".join(f"{a} is a {c.role} at epoch {c.epoch}, input {c.applied}"
                               for a, c in found.items()))
            self.state.heard_at = time.monotonic() - self.timeout / 2

    def _refused_ping(self) -> bool:
        """Whether a backup refused a keep-alive naming a higher epoch (we are fenced)."""
        refusal = self.keepalive.refusal()
        if refusal is not None and self.state.refused(refusal[0]):
            self._fenced(*refusal)
            return True
        return False

    def _aim(self, now: float) -> None:
        """Keep-alives to the current backups (the thread's lease renewed)."""
        self.keepalive.aim(self.state.epoch, tuple(b.address for b in self.backups), now,
                           self._peer_list())

    def _peer_list(self) -> list[str]:
        """What keep-alives list: this primary, then its backups (joining ones last)."""
        return [self.address, *(b.address for b in self.backups if b not in self._joining),
                *(b.address for b in self.backups if b in self._joining)]

    def _take_over(self, now: float, backups: Sequence[str] = ()) -> None:
        """Promoted: ``backups`` (the other live backups) get our snapshot, and we
        answer no worker until each holds it (or died)."""
        silent = now - (self.state.heard_at or now)
        epoch = self.state.promote()
        for address in backups:
            self._asked[address] = ""  # (as if it asked to join: its nonce comes later)
            self._asked_at[address] = now
            self._settle.add(address)
        self.failovers += 1
        core = self.host.core
        if core is not None:
            # the failover's silence is not the workers': their liveness restarts now
            for w in core.live():
                w.last_seen = now
        log.warning("shard %d: failover: replica %d (%s) takes over as primary at epoch %d, "
                    "%.2fs after the primary's last word", self.shard, self.replica,
                    self.address, epoch, silent)
        self.events.write(ev.Failover(shard=self.shard, replica=self.replica, epoch=epoch,
                                      seconds=round(silent, 3), applied=self.state.applied,
                                      address=self.address, backups=list(backups)))
        self._send_snapshots()

    def admit(self, identity: bytes, frames: list[Any], send: Send,
              key: str | None = None) -> bool:
        """Whether ``frames`` go on to the shard's handlers: False for a replication
        message, which is handled here. ``key``: the sender's CURVE key."""
        if wrepl.is_replication(frames):
            try:
                self.on_message(identity, frames, send, key)
            except ProtocolError as exc:
                log.warning("shard %d: a bad replication message: %s", self.shard, exc)
            return False
        return True

    def on_message(self, identity: bytes, frames: list[Any], send: Send,
                   key: str | None = None) -> None:
        """A replication message on the shard's socket; ``send(identity, frames)``."""
        record, rest = wrepl.decode(frames)
        if isinstance(record, wrepl.WhoIs):  # (anyone may ask: it changes nothing)
            send(identity, wrepl.encode(self.role_reply()))
            return
        if isinstance(record, wrepl.OPEN):
            return  # (answers: they come on the sockets that asked, not here)
        sealed = self.gate.admit(identity, record, frames, send, key)
        if sealed is None:
            return
        if isinstance(record, wrepl.Join):
            self._on_join(record, sealed.replica)
        elif isinstance(record, wrepl.Snapshot):
            self._on_snapshot(identity, record, rest, send)
        elif isinstance(record, wrepl.Apply):
            verdict = self.state.receive(record.epoch, record.seq, time.monotonic())
            if verdict is Verdict.HOLD:  # no state to apply it to (a snapshot comes first)
                if record.seq:  # an input, not a keep-alive: whoever sent it takes us for
                    # a backup holding its inputs (a new process at a dead one's address)
                    send(identity, self.key.seal(wrepl.encode(wrepl.Ack(
                        self.state.epoch, record.seq, False,
                        "holds none of this primary's inputs yet: a new process"))))
                return
            if record.peers and verdict is not Verdict.STALE:
                self.peers = list(record.peers)
                self.gate.members.update(record.peers)
            # acknowledged once held, then applied: the primary applies it meanwhile
            send(identity, self.key.seal(wrepl.encode(self._ack(record, verdict))))
            if verdict is Verdict.APPLY:
                if record.kind == "msg":
                    self.host.replay(rest, record.key)
                elif record.kind in ("dead", "left_out"):
                    self.host.replay_death(record.kind, record.workers)

    def _ack(self, record: wrepl.Apply, verdict: Verdict) -> wrepl.Ack:
        if verdict is Verdict.STALE:
            return wrepl.Ack(self.state.epoch, record.seq, False, "a lower epoch")
        if verdict is Verdict.GAP:
            return wrepl.Ack(self.state.epoch, record.seq, False,
                             f"input {record.seq} after {self.state.applied}: inputs missing")
        return wrepl.Ack(self.state.epoch, record.seq, True)

    def export(self, registry: MetricsRegistry, now: float) -> None:
        """This replica's role, epoch, inputs and failovers, and each backup's lag, as
        Prometheus gauges (docs/observability.md), at most every EXPORT_EVERY seconds
        (the loop calls it at every wake-up)."""
        if now - self._exported_at < self.EXPORT_EVERY:
            return
        self._exported_at = now
        me = (self.shard, self.replica)
        registry.set("paramserver_replica_primary", me, float(self.state.writable))
        registry.set("paramserver_replica_epoch", me, self.state.epoch)
        registry.set("paramserver_replica_inputs", me, self.state.applied)
        registry.set("paramserver_replica_failovers_total", me, self.failovers)
        for b in self.backups:
            registry.set("paramserver_replica_backup_lag", (self.shard, b.address),
                         self.state.applied - b.acked)

    def role_reply(self) -> wrepl.RoleReply:
        now = time.monotonic()
        # (a primary answers no one until its backups hold its snapshot: not primary yet)
        role = Role.BACKUP if self.state.writable and not self.writable else self.state.role
        return wrepl.RoleReply(
            role.value, self.state.epoch, self.state.applied,
            self.replica, [b.address for b in self.backups],
            [round(now - b.acked_at, 3) for b in self.backups], self.failovers,
            [self.state.applied - b.acked for b in self.backups])

    def close(self) -> None:
        self.keepalive.close()
        if self._election is not None:
            self._election.close()
            self._election = None
        for b in self.backups:
            b.close()
        self.backups = []
        if self.joiner is not None:
            self.joiner.close()
            self.joiner = None

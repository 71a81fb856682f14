"""Who a replica takes replication messages from (issue 42): the gate every message but
the role probe passes before paramserver/server/replication.py acts on it.

Every replication message but the role probe is sealed with the run's replication key
(paramserver/wire/replauth.py), and a replica takes one only when its seal holds,
names its own shard and another of its replicas, and was never taken before. A
stranger who reaches the port can neither inject inputs, keep-alives or snapshots,
nor ask for the state, nor answer as a backup. Under CURVE the replicas are also each
other's CURVE clients with the shard's own key pair (the servers share one), and a
replica takes every replication message but the role probe from that key only.

What is refused is said: at the 1st, 10th, 100th ... time for a stranger (who cannot
flood the log), at once and as an error for a replica sealing with another key (a
configuration to fix), which is also answered with a :class:`~paramserver.wire.
replication.Refusal` naming our key's fingerprint, so that both sides name both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from paramserver.errors import ConfigError
from paramserver.observe import records as ev
from paramserver.server.config import NO_REPLICATION_KEY
from paramserver.wire import replication as wrepl
from paramserver.wire.replauth import BadSeal, ReplicationKey, Sealed

if TYPE_CHECKING:
    from paramserver.observe.events import EventLog
    from paramserver.server.config import ServerConfig
    from paramserver.wire.curve import CurveKeys

__all__ = ["Gate", "replication_key"]

log = logging.getLogger(__name__)

Send = Callable[[bytes, list[bytes]], None]


def replication_key(config: ServerConfig, curve: CurveKeys | None) -> ReplicationKey:
    """What this replica seals its messages with: the run's key file, else (CURVE) one
    derived from the shard key pair; neither is refused (NO_REPLICATION_KEY)."""
    if config.replication_key:
        return ReplicationKey.load(config.replication_key, config.shard, config.replica)
    if curve is not None:
        return ReplicationKey.from_curve(curve.secret, config.shard, config.replica)
    raise ConfigError(NO_REPLICATION_KEY)


class Gate:
    """One replica's checks of the replication messages it receives."""

    def __init__(self, config: ServerConfig, curve: CurveKeys | None, events: EventLog,
                 address: str) -> None:
        self.shard, self.replica, self.address = config.shard, config.replica, address
        self.size = config.replicas + 1
        self.events = events
        self.key = replication_key(config, curve)
        # CURVE: the only key a replication message other than a role probe is taken from
        self.peer_key = curve.public_text if curve is not None else None
        self.refused = 0  # replication messages refused
        #: every address of the shard's replica set this replica knows of (its peers,
        #: those keep-alives listed): the only ones a join is taken for
        self.members: set[str] = {address, *config.replica_peers}
        self._keys: set[str] = set()  # other keys' fingerprints already said

    def admit(self, identity: bytes, record: wrepl.Record, frames: Sequence[Any], send: Send,
              key: str | None) -> Sealed | None:
        """Who sealed ``frames`` (``record`` decoded from them), or None: refused
        (said, and answered when a replica with another key sent it). ``key``: the
        sender's CURVE key."""
        if self.peer_key is not None and key != self.peer_key:
            self.refused += 1  # a worker's (or anyone's) key: not a replica of ours
            if self.refused in (1, 10, 100, 1000) or self.refused % 10000 == 0:
                log.warning("shard %d: refused %d replication message(s) (the last a %s) "
                            "from key %s: only the shard's own key replicates", self.shard,
                            self.refused, type(record).__name__, key)
            return None
        try:
            sealed = self.key.open(frames)
            if sealed.replica == self.replica or sealed.replica >= self.size:
                raise BadSeal(f"sealed as replica {sealed.replica}, which is "
                              f"{'this one' if sealed.replica == self.replica else 'none'} "
                              f"of this shard's {self.size} replicas")
        except BadSeal as exc:
            self.refusal(f"a {type(record).__name__} refused: {exc}", exc.key_id)
            if exc.key_id is not None:  # a replica with another key: both say so
                send(identity, wrepl.encode(wrepl.Refusal(
                    f"another replication key: {exc}"[:300], self.key.key_id, self.replica,
                    self.shard)))
            return None
        return sealed

    def joins(self, record: wrepl.Join, sender: int) -> bool:
        """Whether a join is taken: a replica asks for its own index, at an address of
        the shard's replica set."""
        if record.replica == sender and record.address in self.members:
            return True
        self.refusal(f"a join of replica {record.replica} at {record.address}, sealed by "
                     f"replica {sender}: not an address of this shard's replica set "
                     f"({', '.join(sorted(self.members))})")
        return False

    def refusal(self, what: str, key_id: str | None = None) -> None:
        """A replication message refused: said at the 1st, 10th, 100th ... time (a
        stranger cannot flood the log), as an error when a replica with another key
        sent it (a configuration to fix), and in the event log."""
        self.refused += 1
        # another key is said at once, each at most once (a stranger may name many)
        told = key_id is not None and key_id not in self._keys and len(self._keys) < 16
        if told:
            self._keys.add(key_id or "")
        if told or self.refused in (1, 10, 100, 1000) or self.refused % 10000 == 0:
            (log.error if told else log.warning)(
                "shard %d: replica %d (%s, replication key %s): %s (%d refused so far)",
                self.shard, self.replica, self.address, self.key.key_id, what, self.refused)
            self.events.write(ev.ReplicationRefused(shard=self.shard, replica=self.replica,
                                                    reason=what[:300], refused=self.refused))

    def mismatch(self, backup: str, why: str) -> str:
        """The line that says this replica and ``backup`` disagree on keys or versions."""
        return (f"shard {self.shard}: replica {self.replica} ({self.address}, replication key "
                f"{self.key.key_id}) and its backup {backup} do not agree: {why}; give every "
                f"replica of a shard the same --replication-key (and the same "
                f"--curve-secret-key, or none)")

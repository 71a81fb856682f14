"""What the launcher does for a shard's replicas (``--replicas``): it starts a new
process in place of one that died while another replica of its shard lives, which
rejoins as a backup of the current primary (paramserver/server/rejoin.py), and it
says what each replica's event log records of failovers and rejoins. A server rank of
``paramserver run`` started again in place of a dead one is configured by the same
two steps (:func:`rejoin_config`): the shard's primary found, then the replacement's
configuration.

A dead replica is replaced only once the shard has a primary other than it (asked of
the live replicas, as workers ask): a replica 0 started while its backup has not
taken over yet would announce itself as primary at epoch 0 to a backup still at
epoch 0. The new process binds the dead one's address (workers know every replica's
address from the start) and is given the live replicas' addresses as its peers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from paramserver.errors import TransportError
from paramserver.observe import records as ev
from paramserver.wire.curve import CurveKeys
from paramserver.workers.failover import ask_roles, primary_of
from paramserver.workers.launch.clusterspec import replica_name

if TYPE_CHECKING:
    from collections.abc import Sequence

    from paramserver.server.config import ServerConfig
    from paramserver.workers.launch.children import ChildProcess
    from paramserver.workers.launch.cluster import LocalCluster

__all__ = ["ReplicaKeeper", "as_replacement", "primary_first", "rejoin_config",
           "replacement_name"]

log = logging.getLogger(__name__)

#: seconds between two role probes while a dead replica waits for its shard's primary
PROBE_EVERY = 0.25
#: the replica events the launcher repeats, each as one line and a launcher event
REPORTED = (b'"event":"failover"', b'"event":"backup_joined"')


def replacement_name(shard: int, replica: int) -> str:
    """A replacement's process name: the replica's own (clusterspec.replica_name),
    ``server0`` for the first primary's, ``server0r1`` for backup 1's: one name per
    replica index, as a restarted shard keeps its name. Its log and events go on
    in the same files, after the dead process's."""
    return replica_name(shard, replica)


def primary_first(live: Sequence[str], curve: CurveKeys | None) -> list[str] | None:
    """A replacement's peers: the shard's live replicas ``live`` (by address), the one
    that says it is the primary first; None while none does (a takeover under way, or
    every replica gone)."""
    found = primary_of(ask_roles(live, timeout=0.2, curve=curve)) if live else None
    if found is None:
        return None
    return [found[0], *(a for a in live if a != found[0])]


def as_replacement(config: ServerConfig, address: str, peers: list[str]) -> ServerConfig:
    """The configuration of a process started in place of a dead replica: at the dead
    one's address (workers know every replica's address from the start), given its
    peers (the primary first), so that it joins them (replica 0 too)."""
    # (not --resume: it takes the live primary's state, which went on from there)
    return dataclasses.replace(config, bind=address, replica_peers=peers, replacement=True,
                               resume=None)


def rejoin_config(config: ServerConfig, replicas: Sequence[str],
                  timeout: float) -> ServerConfig:
    """``paramserver run``'s server rank started again in place of a dead replica
    (``config.replica`` of its shard, whose replicas listen at ``replicas``): the
    replacement's configuration, once another replica says it is the shard's primary
    (asked every PROBE_EVERY, up to ``timeout`` seconds)."""
    address = replicas[config.replica]
    others = [a for a in replicas if a != address]
    curve = (CurveKeys.load(config.curve_secret_key).as_replica()
             if config.curve_secret_key else None)
    deadline = time.monotonic() + timeout
    while (peers := primary_first(others, curve)) is None:
        if time.monotonic() >= deadline:
            raise TransportError(
                f"shard {config.shard}: replica {config.replica} was started again, but no "
                f"other replica ({', '.join(others)}) said it is the primary within "
                f"{timeout:g}s; a replacement rejoins a live primary (with every replica "
                f"gone, resume the run from its checkpoint)")
        time.sleep(PROBE_EVERY)  # (the next probe: a takeover takes the failover timeout)
    return as_replacement(config, address, peers)


class ReplicaKeeper:
    """One launcher's replacements of dead replicas, and its reports of their events."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.due: dict[tuple[int, int], str] = {}  # (shard, replica) -> its address
        self._probed = float("-inf")
        self._offsets: dict[str, int] = {}  # replica name -> bytes of its events read
        self.replaced = 0

    def procs(self, shard: int) -> list[ChildProcess]:
        """The shard's replicas' processes now, by replica index."""
        c = self.cluster
        return [c.servers[shard], *c.backups[shard]]

    def died(self, shard: int, proc: ChildProcess) -> None:
        """``proc`` exited: replace it once the shard has a primary other than it."""
        replica = next(k for k, p in enumerate(self.procs(shard)) if p is proc)
        self.due[(shard, replica)] = self.cluster.replica_sets[shard][replica]

    def tick(self) -> None:
        """Replace each dead replica whose shard has a live primary now."""
        now = time.monotonic()
        if not self.due or now - self._probed < PROBE_EVERY:
            return
        self._probed = now
        for (shard, replica), address in list(self.due.items()):
            live = [a for a, p in zip(self.cluster.replica_sets[shard], self.procs(shard),
                                      strict=True) if p.popen.poll() is None]
            peers = primary_first(live, self.cluster.spec.admin_curve())
            if peers is None:
                continue  # no primary yet (a takeover under way), or none left
            del self.due[(shard, replica)]
            self._replace(shard, replica, address, peers)

    def _replace(self, shard: int, replica: int, address: str, peers: list[str]) -> None:
        c = self.cluster
        name = replacement_name(shard, replica)
        cfg = dataclasses.replace(c.spec.replica_config(shard, replica, c.out),
                                  event_log=str(c.out / "events" / f"{name}.jsonl"))
        cfg = as_replacement(cfg, address, peers)
        old = self.procs(shard)[replica]
        if old.popen.stdout is not None:
            old.popen.stdout.close()
        log.warning("shard %d: starting %s in place of %s, to rejoin as a backup of %s",
                    shard, name, old.name, peers[0])
        proc = c._spawn(name, "paramserver.server.loop", cfg.to_dict(), ready_pipe=True,
                        append=True, host=c.server_host(shard, replica))
        if replica == 0:
            c.servers[shard] = proc
        else:
            c.backups[shard][replica - 1] = proc
        c._gone.discard(name)
        c._await_ready(proc, time.monotonic() + c.spec.startup_timeout)
        self.replaced += 1

    def report(self, name: str) -> None:
        """A line and a launcher event for each failover or rejoin ``name``'s event log
        records since the last call (its other records are not parsed). A rejoin is
        told as the primary saw it (``backup_joined``): the replica holds the snapshot
        and every input since, and the primary waits for it from then on."""
        path = Path(self.cluster.out) / "events" / f"{name}.jsonl"
        offset = self._offsets.get(name, 0)
        try:
            with path.open("rb") as fh:
                fh.seek(offset)
                data = fh.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1  # a torn last line waits for the next call
        self._offsets[name] = offset + end
        for line in data[:end].splitlines():
            if not any(tag in line for tag in REPORTED):
                continue
            try:
                rec = _decoder.decode(line)
            except msgspec.DecodeError as exc:  # (a replica's log: its own writing)
                log.warning("%s: an unreadable event: %s", path, exc)
                continue
            if isinstance(rec, _Joined):
                self._rejoined(rec)
            else:
                self._failed_over(name, rec)

    def _failed_over(self, name: str, rec: _Failover) -> None:
        log.warning("shard %d failed over: %s (replica %d, %s) is its primary at epoch %d, "
                    "%.2fs after the old primary's last word", rec.shard, name, rec.replica,
                    rec.address, rec.epoch, rec.seconds)
        self.cluster.observer.events.write(ev.LauncherFailover(process=name, shard=rec.shard,
                                                               replica=rec.replica,
                                                               address=rec.address, epoch=rec.epoch,
                                                               seconds=rec.seconds))

    def _rejoined(self, rec: _Joined) -> None:
        replicas = self.cluster.replica_sets[rec.shard]
        replica = replicas.index(rec.backup) if rec.backup in replicas else -1
        name = self.procs(rec.shard)[replica].name if replica >= 0 else rec.backup
        log.warning("shard %d: %s rejoined as a backup of %s at epoch %d (the primary's "
                    "state at input %d, then every input since; %.2fs after it asked)",
                    rec.shard, name, rec.primary, rec.epoch, rec.seq, rec.seconds)
        self.cluster.observer.events.write(ev.LauncherRejoined(process=name, shard=rec.shard,
                                                               replica=replica, address=rec.backup,
                                                               primary=rec.primary, epoch=rec.epoch,
                                                               seq=rec.seq, seconds=rec.seconds))


class _Failover(msgspec.Struct, tag_field="event", tag="failover"):
    """The fields of a replica's ``failover`` record the launcher repeats."""

    shard: int
    replica: int
    address: str
    epoch: int
    seconds: float


class _Joined(msgspec.Struct, tag_field="event", tag="backup_joined"):
    """The fields of a primary's ``backup_joined`` record the launcher repeats."""

    shard: int
    backup: str
    primary: str
    epoch: int
    seq: int
    seconds: float


_decoder = msgspec.json.Decoder(_Failover | _Joined)

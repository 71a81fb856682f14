"""Who may speak on a shard's replication links: a per-run secret every replica holds,
and a seal (an HMAC-SHA256) on every replication message but the role probe (issue 42).

Replication messages share the shard's ROUTER socket with workers, which may not use
CURVE, so the socket cannot tell a replica from anyone else who reaches the port. A
replica proves it is one by sealing each message it sends with the run's replication
key: the seal names the shard, the sender's replica index, its process's session and
a counter, and its MAC covers those and every frame after it (the record, and a
forwarded input's own frames). A receiver takes a message only when the MAC is right
under its own key, the shard is its own, and (session, counter) was never taken
before (:class:`ReplayWindow`): a message captured once and sent again is refused,
and so is one of an earlier process of the same replica.

The key is 32 random bytes in a file only its owner may read (:func:`make_key_file`,
``paramserver keys replication FILE``); launch and run make one per run. Under CURVE
without one, the key is derived from the shard key pair every replica holds already.
A seal also carries the key's fingerprint (:attr:`ReplicationKey.key_id`, a hash
that reveals nothing of the key), so that two replicas given different keys name
both in one line instead of ignoring each other in silence.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import itertools
import os
import secrets
import stat
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paramserver.errors import ConfigError, ErrorCode, ProtocolError

__all__ = ["KEY_BYTES", "SEAL", "BadSeal", "ReplayWindow", "ReplicationKey", "Sealed",
           "make_key_file", "shared_key_file"]

#: bytes of a replication key
KEY_BYTES = 32
#: the seal frame: version, shard, sender replica, session, counter, key id, MAC
SEAL = struct.Struct("!BIHQQ8s32s")
_VERSION = 1
_MAC_AT = SEAL.size - 32
#: counters a receiver remembers per sender behind the highest it took: messages sent
#: from one process's several sockets (inputs, keep-alives, join requests) arrive in
#: another order than they were numbered, by at most this many
WINDOW = 1 << 14


class BadSeal(ProtocolError):
    """A replication message that is not a replica's of this shard: no seal, a wrong
    MAC, another key or shard, or a replay. ``key_id``: the fingerprint the seal
    names when the MAC fails under our key (another key: a configuration mismatch)."""

    def __init__(self, message: str, key_id: str | None = None) -> None:
        super().__init__(ErrorCode.FORBIDDEN, message)
        self.key_id = key_id


def _bytes(frame: Any) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame)


@dataclass
class ReplayWindow:
    """Which (session, counter) pairs one sender's messages were taken with: a pure
    anti-replay rule. A newer session (a new process of that replica: sessions are
    its start time in ns) replaces an older one, whose messages are refused from
    then on; within a session each counter is taken once, in any order within
    :data:`WINDOW` of the highest."""

    session: int = -1
    high: int = -1
    seen: int = 0  # bit i: counter high - i was taken

    def take(self, session: int, counter: int) -> str | None:
        """Take one message; None, or why it is refused."""
        if session < self.session:
            return "a replay: an earlier process of that replica"
        if session > self.session:
            self.session, self.high, self.seen = session, counter, 1
            return None
        if counter > self.high:
            shift = counter - self.high
            self.seen = ((self.seen << shift) | 1) & ((1 << WINDOW) - 1) if shift < WINDOW else 1
            self.high = counter
            return None
        back = self.high - counter
        if back >= WINDOW:
            return f"too old: {back} messages behind the newest"
        if self.seen >> back & 1:
            return "a replay: that message was taken already"
        self.seen |= 1 << back
        return None


@dataclass(frozen=True)
class Sealed:
    """Who sealed a message that passed: its shard's replica ``replica``."""

    replica: int
    session: int


@dataclass
class ReplicationKey:
    """A replica's replication key: it seals what this replica sends (:meth:`seal`)
    and checks what it receives (:meth:`open`, one replay window per sender)."""

    secret: bytes
    shard: int
    replica: int
    #: this process's session: its start time, so that a later process of the same
    #: replica counts as newer (the replacement of a dead one)
    session: int = field(default_factory=time.time_ns)
    _counter: Any = field(default_factory=lambda: itertools.count(1), repr=False)
    _windows: dict[int, ReplayWindow] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise ConfigError("a replication key needs at least 16 bytes")

    @classmethod
    def load(cls, path: str | Path, shard: int, replica: int) -> ReplicationKey:
        """The key in ``path`` (hex text, :func:`make_key_file`), refused in one line
        if others may read the file."""
        try:
            info = os.stat(path)
            text = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the replication key {path}: {exc}") from exc
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"the replication key {path} may be read by other users "
                              f"(mode {stat.S_IMODE(info.st_mode):o}): chmod 600 it")
        try:
            secret = bytes.fromhex(text)
        except ValueError:
            secret = b""
        if len(secret) < 16:
            raise ConfigError(f"{path} holds no replication key (hex text of at least 16 "
                              f"bytes; `paramserver keys replication FILE` makes one)")
        return cls(secret, shard, replica)

    @classmethod
    def from_curve(cls, curve_secret: bytes, shard: int, replica: int) -> ReplicationKey:
        """Under CURVE without a key file: a key derived from the shard key pair's
        secret, which every replica of the run holds (and no worker)."""
        return cls(hashlib.sha256(b"paramserver replication key\0" + curve_secret).digest(),
                   shard, replica)

    def reader(self) -> ReplicationKey:
        """The same key for another thread: one session and counter (what it seals is
        numbered with this one's), replay windows of its own (what it reads)."""
        return dataclasses.replace(self, _windows={})

    @property
    def key_id(self) -> str:
        """The key's fingerprint (16 hex digits; says nothing of the key itself)."""
        return self._key_id().hex()

    def _key_id(self) -> bytes:
        return hashlib.sha256(b"paramserver key id\0" + self.secret).digest()[:8]

    def _mac(self, head: bytes, frames: Sequence[Any]) -> bytes:
        mac = hmac.new(self.secret, head, hashlib.sha256)
        for frame in frames:  # (each length first: frames cannot be split otherwise)
            view = _bytes(frame)
            mac.update(struct.pack("!Q", view.nbytes))
            mac.update(view)
        return mac.digest()

    def seal(self, frames: Sequence[Any]) -> list[Any]:
        """``frames`` (``[MAGIC, seal placeholder, record, ...]``) with their seal."""
        head = SEAL.pack(_VERSION, self.shard, self.replica, self.session,
                         next(self._counter), self._key_id(), b"")[:_MAC_AT]
        return [frames[0], head + self._mac(head, frames[2:]), *frames[2:]]

    def open(self, frames: Sequence[Any]) -> Sealed:
        """Check the seal of ``frames`` (a replication message); who sealed it, or
        :class:`BadSeal`. A message is taken once: a second call refuses it."""
        seal = bytes(_bytes(frames[1])) if len(frames) > 2 else b""
        if len(seal) != SEAL.size:
            raise BadSeal("not sealed with a replication key")
        version, shard, replica, session, counter, key_id, mac = SEAL.unpack(seal)
        if version != _VERSION:
            raise BadSeal(f"a seal of version {version} (ours: {_VERSION}): a replica of "
                          f"another paramserver version")
        if not hmac.compare_digest(mac, self._mac(seal[:_MAC_AT], frames[2:])):
            if key_id != self._key_id():
                raise BadSeal(f"sealed with another replication key ({key_id.hex()})",
                              key_id.hex())
            raise BadSeal("a wrong seal (forged, or altered on the way)")
        if shard != self.shard:
            raise BadSeal(f"a replica of shard {shard}, not of this shard {self.shard}")
        why = self._windows.setdefault(replica, ReplayWindow()).take(session, counter)
        if why is not None:
            raise BadSeal(f"from replica {replica}: {why}")
        return Sealed(replica, session)


def make_key_file(path: str | Path, force: bool = False) -> Path:
    """Write a new replication key to ``path``, readable by its owner only (made so
    from the start: no moment where others may read it). Refuses to replace one unless
    ``force``."""
    target = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, flags, 0o600)
    except FileExistsError:
        raise ConfigError(f"{target} exists already; refusing to replace the replication "
                          f"key (force to replace it)") from None
    except OSError as exc:
        raise ConfigError(f"cannot write a replication key to {target}: {exc}") from exc
    with os.fdopen(fd, "w") as fh:
        os.fchmod(fd, 0o600)
        fh.write(secrets.token_hex(KEY_BYTES) + "\n")
    return target


def shared_key_file(path: str | Path) -> Path:
    """The replication key at ``path``, made there by the first of several processes
    that ask at once (each of a run's ranks on a shared folder): written aside, then
    linked into place, so that no process reads half a key."""
    target = Path(path)
    if target.exists():
        return target
    aside = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}")
    make_key_file(aside)
    try:
        os.link(aside, target)
    except FileExistsError:
        pass  # another rank was first: its key is the run's
    except OSError as exc:
        raise ConfigError(f"cannot write a replication key to {target}: {exc}") from exc
    finally:
        aside.unlink(missing_ok=True)
    return target

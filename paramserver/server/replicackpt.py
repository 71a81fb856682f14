"""Who writes a replicated shard's checkpoints, and the thread that writes them.

A shard's replicas share its checkpoint directory. Which one writes follows
:meth:`paramserver.core.replica.ReplicaState.writes_checkpoints`: a backup (it applies
the primary's inputs in the same order, so at the same input it holds the same state,
and its disk stalls no worker), the primary only while it counts no backup (its
backup dropped, or it is a promoted backup without one of its own yet), a fenced or
joining replica never.

Exactly one process writes into ``DIR/shardN`` at a time: each write holds an
advisory lock (``fcntl.flock``) on ``DIR/shardN/.writer`` from its first file to its
pruning, and the kernel lets go of it for a process that dies mid-write. So two
replicas that both write for a moment (a failover or a rejoin moving the role; the
primary's CHECKPOINT op or divergence checkpoint beside its backup's) take turns,
and a writer that waits keeps only its newest capture.

A checkpoint is *captured* on the apply thread (the state at one input, its tensors
copied: no I/O) and *written* on this module's thread, by the same atomic steps as
any checkpoint (:func:`paramserver.persist.checkpoint.save_shard`), so neither the
backup's apply loop nor a lone primary's stalls for the disk. At stop
(:meth:`ReplicaCheckpoints.final`) the thread's last write is finished, the lock is
taken, and the shard's final state is written unless ``LATEST`` already holds it:
the manifest records the replica input it was taken at, and two replicas at the same
input hold the same state. The launcher stops the backups first; a primary that
counts a backup gives it two failover timeouts to write the final checkpoint before
it writes its own (its backup may have died).

Fault injection, for tests only: with :data:`HOLD_ENV` naming a directory, a write
that finds ``hold-shardN`` there once its tensors are written creates
``held-shardN-PID`` (naming the file being written) and waits until ``hold-shardN``
is removed (then removes its own), so that a test can
kill a replica (the writer, or the other one) in the middle of a checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from paramserver.observe import records as ev
from paramserver.persist.checkpoint import CheckpointError, latest_path, set_write_hook
from paramserver.util import faults

if TYPE_CHECKING:
    from paramserver.core.replica import ReplicaState
    from paramserver.server.checkpointer import Capture, Checkpointer
    from paramserver.server.replhost import ReplicationHost

__all__ = ["HOLD_ENV", "LOCK_NAME", "Replica", "ReplicaCheckpoints"]

log = logging.getLogger(__name__)

#: the lock file in each shard's checkpoint folder
LOCK_NAME = ".writer"
#: fault injection (tests): a directory where ``hold-shardN`` holds shard N's writes
HOLD_ENV = faults.HOLD_CHECKPOINT
#: seconds between two tries of a lock another replica holds
LOCK_POLL = 0.05
#: how long a checkpoint written on the apply thread waits for another replica's write
LOCK_WAIT = 20.0
#: how long (in failover timeouts) a primary's final checkpoint waits for its backup's
BACKUP_WAIT = 2.0
#: the manifest field of the replica input a checkpoint was captured at
INPUT_FIELD = "replica_input"


class Replica(Protocol):
    """What the writer asks of its replica's replication (replication.py's
    Replication): whether this replica writes now, and at which input."""

    host: ReplicationHost
    state: ReplicaState
    replica: int
    timeout: float

    @property
    def writes_checkpoints(self) -> bool: ...


class ReplicaCheckpoints:
    """Shard checkpoints of one replica: captured by the apply thread when due and
    this replica is the writer, written on a thread, each write under the shard's
    writer lock. ``take(copy)`` captures the shard's state now (None: no state)."""

    def __init__(self, checkpoints: Checkpointer, replication: Replica,
                 take: Callable[[bool], Capture | None]) -> None:
        self.checkpoints = checkpoints
        self.replication = replication
        self.take = take
        self.shard = checkpoints.shard
        self._cond = threading.Condition()
        self._mutex = threading.Lock()  # this process's writes, one at a time
        self._pending: Capture | None = None
        self._active = False  # this replica is the writer (the apply thread says)
        self._closing = False
        self._done: list[tuple[int, str | None, str | None]] = []  # (version, path, error)
        self._thread: threading.Thread | None = None
        hold = faults.hold_checkpoint()
        if hold:
            set_write_hook(_Hold(Path(hold), self.shard))

    # ------------------------------------------------------------------ apply thread

    def tick(self) -> None:
        """Report finished writes; capture a due checkpoint if this replica writes."""
        self.report()
        writer = self.replication.writes_checkpoints
        with self._cond:
            self._active = writer
            if not writer:
                self._pending = None
                return
        if not self.checkpoints.due(self.replication.host.core):
            return
        taken = self._take(copy=True)
        if taken is None:
            return
        self.checkpoints.last = (time.monotonic(), taken.version)  # due once per version
        with self._cond:
            self._pending = taken  # an older one not written yet gives way
            self._cond.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"checkpoints-shard{self.shard}")
            self._thread.start()

    def report(self) -> None:
        """The events of the writes the thread finished (written here: one writer of
        the event log)."""
        with self._cond:
            done, self._done = self._done, []
        for version, path, error in done:
            if path is not None:
                self.checkpoints.written(version, path)
            else:
                log.error("shard %d: the checkpoint at version %d was not written: %s",
                          self.shard, version, error)
                self.checkpoints.events.write(ev.CheckpointFailed(shard=self.shard, version=version,
                                                                  error=(error or "")[:300]))

    def save(self, directory: str | None) -> str | None:
        """Write the shard's checkpoint now, whoever the writer is (the CHECKPOINT op,
        a divergence), once no other replica is writing one; the manifest path."""
        deadline = time.monotonic() + LOCK_WAIT
        with self._writing(lambda: time.monotonic() < deadline) as locked:
            if not locked:
                raise CheckpointError(f"shard {self.shard}: another replica held "
                                      f"{self._lock_path()} for {LOCK_WAIT:g}s")
            return self.checkpoints.store(self._take(copy=False), directory)

    def final(self) -> str | None:
        """At stop: the thread's last write finished, then the shard's final state
        written unless LATEST holds it already (the other replica wrote it at the
        same input); the manifest path (None: not written here)."""
        self.close()
        self.report()
        directory = self.checkpoints.directory
        if directory is None or not self.replication.state.writes_checkpoints(0):
            return None  # (a fenced or joining replica holds no state to keep)
        seq = self.replication.state.applied
        if not self.replication.writes_checkpoints:
            # a primary with a backup: the launcher stopped the backup first, which
            # writes it; a dead one's is written here, after a while
            wait = time.monotonic() + BACKUP_WAIT * self.replication.timeout
            while _latest_input(directory, self.shard) != seq and time.monotonic() < wait:
                time.sleep(LOCK_POLL)
        deadline = time.monotonic() + LOCK_WAIT
        with self._writing(lambda: time.monotonic() < deadline) as locked:
            if not locked:
                log.error("shard %d: no final checkpoint from this replica: another one "
                          "held %s for %gs", self.shard, self._lock_path(), LOCK_WAIT)
                return None
            if _latest_input(directory, self.shard) == seq:
                log.info("shard %d: the final checkpoint (input %d) is written already",
                         self.shard, seq)
                return None
            return self.checkpoints.store(self._take(copy=False), directory)

    def close(self) -> None:
        """Stop the thread once the write under way (if any) is done."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _take(self, copy: bool) -> Capture | None:
        taken = self.take(copy)
        if taken is not None:
            taken.meta[INPUT_FIELD] = self.replication.state.applied
        return taken

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return  # (what is pending is older than what final() writes)
                taken, self._pending = self._pending, None
            assert taken is not None
            outcome: tuple[int, str | None, str | None] | None = None
            with self._writing(lambda: self._active and not self._closing) as locked:
                if locked:  # (else: no longer the writer meanwhile, or stopping)
                    try:
                        path = self.checkpoints.write(taken, self.checkpoints.directory or "")
                        outcome = (taken.version, path, None)
                    except (OSError, CheckpointError, ValueError, RuntimeError) as exc:
                        outcome = (taken.version, None, f"{type(exc).__name__}: {exc}")
            if outcome is not None:
                with self._cond:
                    self._done.append(outcome)

    # ------------------------------------------------------------------ the lock

    def _lock_path(self) -> Path:
        return Path(self.checkpoints.directory or ".") / f"shard{self.shard}" / LOCK_NAME

    @contextlib.contextmanager
    def _writing(self, go_on: Callable[[], bool]) -> Iterator[bool]:
        """Hold the shard's writer lock for one write, trying while ``go_on()``;
        yields whether it is held."""
        with self._mutex:
            fd = self._lock(go_on)
            try:
                yield fd is not None
            finally:
                if fd is not None:
                    with contextlib.suppress(OSError):
                        fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)

    def _lock(self, go_on: Callable[[], bool]) -> int | None:
        path = self._lock_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        warned = False
        while True:
            # never through a link another local user planted, never inherited by a child
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
            else:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())  # who writes, for an operator
                return fd
            if not go_on():
                return None
            if not warned:
                warned = True
                log.info("shard %d: replica %d waits for %s (another replica writes a "
                         "checkpoint)", self.shard, self.replication.replica, path)
            time.sleep(LOCK_POLL)


def _latest_input(directory: str, shard: int) -> int | None:
    """The replica input the shard's LATEST checkpoint was captured at (None: none,
    or not recorded)."""
    try:
        manifest = json.loads(latest_path(directory, shard).with_suffix(".json").read_text())
    except (CheckpointError, OSError, ValueError):
        return None
    seq = manifest.get(INPUT_FIELD) if isinstance(manifest, dict) else None
    return seq if type(seq) is int else None


class _Hold:
    """The write hook of :data:`HOLD_ENV` (tests): hold a write mid-way while
    ``hold-shardN`` exists."""

    def __init__(self, folder: Path, shard: int) -> None:
        self.hold = folder / f"hold-shard{shard}"
        self.held = folder / f"held-shard{shard}-{os.getpid()}"

    def __call__(self, step: str, path: Path) -> None:
        if step != "tensors_written" or not self.hold.exists():
            return
        self.held.write_text(str(path))
        deadline = time.monotonic() + 120
        while self.hold.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.held.unlink(missing_ok=True)

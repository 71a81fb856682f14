"""Who writes a replicated shard's checkpoints, without processes or sockets: the
rule (paramserver/core/replica.py) and the writer lock, the thread and the final
checkpoint (paramserver/server/replicackpt.py)."""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from paramserver.core.replica import ReplicaState, Role
from paramserver.observe.events import EventLog
from paramserver.observe.records import kind_of
from paramserver.persist.checkpoint import load_shard
from paramserver.server.checkpointer import Capture, Checkpointer
from paramserver.server.replicackpt import LOCK_NAME, ReplicaCheckpoints


def test_a_backup_writes_and_a_primary_only_alone():
    assert ReplicaState(Role.BACKUP).writes_checkpoints(0)
    assert ReplicaState(Role.PRIMARY).writes_checkpoints(0)
    assert not ReplicaState(Role.PRIMARY).writes_checkpoints(1)
    assert not ReplicaState(Role.FENCED).writes_checkpoints(0)
    assert not ReplicaState(Role.JOINING).writes_checkpoints(0)


class _Replica:
    """A replica as ReplicaCheckpoints sees it: its role, its input, its core's version."""

    def __init__(self, role: Role, backups: int = 0) -> None:
        self.state = ReplicaState(role, applied=7)
        self.backups = backups
        self.timeout = 0.1  # (failover: how long a primary waits for its backup's final)
        self.replica = 0 if role is Role.PRIMARY else 1
        self.host = SimpleNamespace(core=SimpleNamespace(version=3, between_rounds=True))

    @property
    def writes_checkpoints(self) -> bool:
        return self.state.writes_checkpoints(self.backups)


def _writer(directory: Path, replica: _Replica, events: list[str]) -> ReplicaCheckpoints:
    def take(copy: bool) -> Capture:
        version = replica.host.core.version
        return Capture(version, {"param/w": torch.full((4,), float(version))},
                       {"version": version})

    log = EventLog(None)
    log.write = lambda record, t=None: events.append(kind_of(record))
    return ReplicaCheckpoints(Checkpointer(0, str(directory), log, every=1),
                              replica, take)


def _until(what: str, ready: Any) -> None:
    deadline = time.monotonic() + 20
    while not ready():
        assert time.monotonic() < deadline, f"no {what}"
        time.sleep(0.01)


def test_a_write_waits_while_another_process_holds_the_lock(tmp_path, caplog):
    events: list[str] = []
    writer = _writer(tmp_path, _Replica(Role.BACKUP), events)
    (tmp_path / "shard0").mkdir()
    fd = os.open(tmp_path / "shard0" / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another replica's write under way
    try:
        with caplog.at_level(logging.INFO, logger="paramserver.server.replicackpt"):
            writer.tick()  # captured, handed to the thread: the apply thread goes on
            _until("wait for the lock", lambda: "waits for" in caplog.text)
        assert not (tmp_path / "shard0" / "LATEST").exists()
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def reported() -> bool:
        writer.tick()
        return "checkpoint" in events
    _until("checkpoint written once the lock was free", reported)
    tensors, meta = load_shard(tmp_path, 0)
    assert meta["version"] == 3 and meta["replica_input"] == 7
    assert torch.equal(tensors["param/w"], torch.full((4,), 3.0))
    writer.close()


def test_a_primary_with_a_backup_captures_nothing(tmp_path):
    events: list[str] = []
    writer = _writer(tmp_path, _Replica(Role.PRIMARY, backups=1), events)
    writer.tick()
    writer.close()
    assert writer._thread is None and not (tmp_path / "shard0").exists()


def test_the_final_checkpoint_is_written_once_per_input(tmp_path):
    backup, primary = _Replica(Role.BACKUP), _Replica(Role.PRIMARY, backups=1)
    events: list[str] = []
    assert _writer(tmp_path, backup, events).final() is not None
    # the primary at the same input holds the same state: LATEST has it already
    assert _writer(tmp_path, primary, events).final() is None
    primary.state.applied += 1  # an input the backup never saw: written again
    path = _writer(tmp_path, primary, events).final()
    assert path is not None and path.endswith("v0000000003-1.json")
    assert events == ["checkpoint", "checkpoint"]
    # a fenced replica's state is its own, never the shard's
    fenced = _Replica(Role.FENCED)
    fenced.state.applied += 5
    assert _writer(tmp_path, fenced, events).final() is None


@pytest.mark.parametrize("role", [Role.BACKUP, Role.PRIMARY])
def test_the_lock_file_is_never_followed_through_a_link(tmp_path, role):
    (tmp_path / "shard0").mkdir()
    target = tmp_path / "elsewhere"
    target.write_text("not ours")
    (tmp_path / "shard0" / LOCK_NAME).symlink_to(target)
    with pytest.raises(OSError):
        _writer(tmp_path, _Replica(role), []).save(None)
    assert target.read_text() == "not ours"


def test_a_primary_with_a_backup_still_writes_a_checkpoint_it_is_asked_for(tmp_path):
    """The CHECKPOINT op (or a divergence) on the primary: written there and then, under
    the lock, beside the backup's periodic ones."""
    events: list[str] = []
    path = _writer(tmp_path, _Replica(Role.PRIMARY, backups=1), events).save(None)
    assert path is not None and path.endswith("v0000000003.json")
    assert events == ["checkpoint"] and load_shard(tmp_path, 0)[1]["version"] == 3

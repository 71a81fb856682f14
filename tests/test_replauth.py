"""The replication links' trust (issue 42), without a shard: the seal and its replay
windows (paramserver/wire/replauth.py), the key file, the pure rules a sealed peer
still answers to (a snapshot's plan, a dropped backup's election), a CURVE mismatch
seen from the primary's link, and the CLI's refusal of replicas without a key."""

from __future__ import annotations

import stat
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from click.testing import CliRunner

from paramserver.core.replica import Candidate, Role, Takeover, elect, snapshot_fault
from paramserver.errors import ConfigError
from paramserver.wire import replication as wrepl
from paramserver.wire.replauth import (
    WINDOW,
    BadSeal,
    ReplayWindow,
    ReplicationKey,
    make_key_file,
    shared_key_file,
)

SECRET = b"s" * 32


def _apply(seq: int) -> list[Any]:
    return [*wrepl.encode(wrepl.Apply(0, seq, 1.0, "msg")), b"the input's frame"]


def test_a_sealed_message_is_taken_once_and_only_as_sealed() -> None:
    primary, backup = ReplicationKey(SECRET, 3, 0), ReplicationKey(SECRET, 3, 1)
    sealed = primary.seal(_apply(1))
    assert backup.open(sealed).replica == 0
    with pytest.raises(BadSeal, match="a replay"):
        backup.open(sealed)  # the same message again
    with pytest.raises(BadSeal, match="not sealed"):
        backup.open(_apply(2))
    altered = primary.seal(_apply(2))
    altered[-1] = b"another input"  # (any frame after the seal is covered)
    with pytest.raises(BadSeal, match="wrong seal"):
        backup.open(altered)
    with pytest.raises(BadSeal, match="not of this shard"):
        ReplicationKey(SECRET, 4, 1).open(primary.seal(_apply(3)))
    stranger = ReplicationKey(b"x" * 32, 3, 0)
    with pytest.raises(BadSeal, match="another replication key") as other:
        backup.open(stranger.seal(_apply(4)))
    assert other.value.key_id == stranger.key_id != backup.key_id
    # another thread's messages (keep-alives): one numbering, so no replay across them
    reader = primary.reader()
    assert backup.open(reader.seal(_apply(5))).session == primary.session


def test_a_later_process_of_a_replica_replaces_the_earlier_one() -> None:
    backup = ReplicationKey(SECRET, 0, 1)
    old = ReplicationKey(SECRET, 0, 0, session=100)
    new = ReplicationKey(SECRET, 0, 0, session=200)
    captured = old.seal(_apply(1))
    backup.open(new.seal(_apply(1)))
    with pytest.raises(BadSeal, match="an earlier process"):
        backup.open(captured)


def test_the_replay_window_takes_each_counter_once_in_any_order() -> None:
    w = ReplayWindow()
    assert w.take(1, 10) is None and w.take(1, 12) is None
    assert w.take(1, 11) is None  # late, from another socket of the sender
    assert w.take(1, 11) is not None and w.take(1, 12) is not None
    assert w.take(1, 12 + WINDOW) is None
    assert "too old" in (w.take(1, 11) or "")
    assert w.take(0, 99) is not None  # an earlier session
    assert w.take(2, 1) is None  # a later one starts afresh


def test_a_key_file_is_made_private_and_refused_when_others_may_read_it(tmp_path: Path
                                                                        ) -> None:
    path = make_key_file(tmp_path / "run.key")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = ReplicationKey.load(path, 0, 1)
    assert len(key.secret) == 32
    with pytest.raises(ConfigError, match="exists already"):
        make_key_file(path)
    assert shared_key_file(path) == path and ReplicationKey.load(path, 0, 0).secret == key.secret
    made = shared_key_file(tmp_path / "shared" / "replication.key")
    assert stat.S_IMODE(made.stat().st_mode) == 0o600
    assert [p.name for p in made.parent.iterdir()] == ["replication.key"]
    path.chmod(0o640)
    with pytest.raises(ConfigError, match="chmod 600"):
        ReplicationKey.load(path, 0, 1)
    (tmp_path / "bad.key").write_text("not hex\n")
    (tmp_path / "bad.key").chmod(0o600)
    with pytest.raises(ConfigError, match="holds no replication key"):
        ReplicationKey.load(tmp_path / "bad.key", 0, 1)


def test_a_snapshot_never_empties_a_replica_nor_brings_another_plan() -> None:
    plan = {"shards": 1, "tensors": [["w", [2]]]}
    assert snapshot_fault(None, None, False) is None  # (a primary with no plan yet)
    assert snapshot_fault(None, plan, True) is None
    assert snapshot_fault(plan, plan, True) is None
    assert "empty" in (snapshot_fault(plan, None, False) or "")
    assert "another shard plan" in (snapshot_fault(plan, {"shards": 2}, True) or "")
    assert "without the state" in (snapshot_fault(None, plan, False) or "")


def test_a_backup_its_primary_dropped_joins_it_again_instead_of_taking_over() -> None:
    me = Candidate(Role.BACKUP, 0, 5, 1)
    alive = Candidate(Role.PRIMARY, 0, 9, 0, ("tcp://b:1",))
    assert elect(me, [alive], "tcp://b:1") is Takeover.WAIT
    assert elect(me, [alive], "tcp://c:1") is Takeover.FOLLOW
    assert elect(me, [], "tcp://c:1") is Takeover.PROMOTE  # (a dead primary answers not)


def test_a_curve_handshake_a_backup_refuses_is_a_mismatch_the_primary_tells() -> None:
    """A CURVE primary's link to a backup without CURVE (a plaintext ROUTER here): the
    failed handshake names the cause within a few seconds, instead of a silent wait."""
    from paramserver.server.backuplink import BackupLink
    from paramserver.wire.curve import CurveKeys

    public, secret = zmq.curve_keypair()
    plain = zmq.Context.instance().socket(zmq.ROUTER)
    plain.setsockopt(zmq.LINGER, 0)
    address = f"tcp://127.0.0.1:{plain.bind_to_random_port('tcp://127.0.0.1')}"
    link = BackupLink(address, zmq.Context.instance(), ReplicationKey(SECRET, 0, 0), 1.0,
                      CurveKeys(public, secret).as_replica())
    try:
        deadline = time.monotonic() + 10.0
        while link.mismatch is None and time.monotonic() < deadline:
            zmq.select([link.monitor], [], [], 0.1)
            link.dead(time.monotonic(), 1.0)  # (reads the monitor's events)
        assert link.mismatch is not None and "CURVE handshake" in link.mismatch
    finally:
        link.close()
        plain.close(0)


def test_replicas_by_hand_need_a_replication_key(tmp_path: Path) -> None:
    from paramserver.cli.main import main

    result = CliRunner().invoke(main, ["server", "--replicas", "1", "--replica", "1"])
    assert result.exit_code == 2 and "--replicas needs --replication-key" in result.output
    made = CliRunner().invoke(main, ["keys", "replication", str(tmp_path / "run.key")])
    assert made.exit_code == 0, made.output
    assert stat.S_IMODE((tmp_path / "run.key").stat().st_mode) == 0o600
    again = CliRunner().invoke(main, ["keys", "replication", str(tmp_path / "run.key")])
    assert again.exit_code == 1 and "exists already" in again.output

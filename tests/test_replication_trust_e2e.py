"""A stranger on the replication links (issue 42, defects 1-5): a shard's replicas
started by hand as real processes on loopback (tests/replicas_by_hand.py), attacked
by a plaintext peer that reaches their ports but holds no replication key.

Each attack is sent twice, in this version's frames unsealed and in the frames of
the version before seals (``\\x00psrepl1``, which that version took from anyone):
neither may change a replica's state. What a replica holds is read back with the
role probe, on the attacker's own socket, after its attack (a ROUTER handles one
peer's messages in order)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from paramserver.wire import replication as wrepl
from paramserver.wire.curve import generate_curve_keys
from paramserver.wire.replauth import make_key_file
from tests.replicas_by_hand import Replica, replica_config, start

LIMIT = 30.0  # seconds a replica may take to do what a test waits for


def _forged(record: wrepl.Record) -> list[list[bytes]]:
    """``record`` as a stranger sends it: unsealed, and as the unsealed version took it."""
    return [wrepl.encode(record), [b"\x00psrepl1", msgspec.msgpack.encode(record)]]


@contextlib.contextmanager
def _stranger(address: str) -> Iterator[zmq.Socket[Any]]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close(0)


def _role(sock: zmq.Socket[Any]) -> wrepl.RoleReply:
    """Ask on ``sock`` (after what it sent before) which role its replica holds."""
    sock.send_multipart(wrepl.encode(wrepl.WhoIs()))
    deadline = time.monotonic() + LIMIT
    while sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
        record, _ = wrepl.decode(sock.recv_multipart())
        if isinstance(record, wrepl.RoleReply):
            return record
    raise AssertionError("no answer to the role probe")


def _attack(address: str, record: wrepl.Record) -> wrepl.RoleReply:
    with _stranger(address) as sock:
        for frames in _forged(record):
            sock.send_multipart(frames)
        return _role(sock)


def _pair(tmp_path: Path) -> Iterator[tuple[Replica, Replica]]:
    """A primary and its backup (failover timeout 1 s), sharing the run's key."""
    started: list[Replica] = []
    try:
        backup = start("backup", replica_config(tmp_path, "backup", 1.0, replica=1), tmp_path)
        started.append(backup)
        primary = start("primary", replica_config(tmp_path, "primary", 1.0,
                                                  replica_peers=[backup.address]), tmp_path)
        started.append(primary)
        yield primary, backup
    finally:
        for r in started:
            r.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Replica, Replica]]:
    """One pair for the attacks that must leave it as it was (their checks say so)."""
    yield from _pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture
def own_pair(tmp_path: Path) -> Iterator[tuple[Replica, Replica]]:
    yield from _pair(tmp_path)


def test_a_forged_input_is_not_taken_by_the_backup(pair: tuple[Replica, Replica]) -> None:
    """Defect 1: an input numbered next, from a stranger, would have taken the place of
    the primary's own under that number (acknowledged, never applied)."""
    _, backup = pair
    with _stranger(backup.address) as sock:
        before = _role(sock)
    after = _attack(backup.address, wrepl.Apply(before.epoch, before.applied + 1, 0.0,
                                                "dead", workers=[0]))
    assert (after.role, after.epoch, after.applied) == ("backup", 0, before.applied)
    assert "refused" in backup.log.read_text()


def test_a_forged_snapshot_does_not_depose_the_primary(pair: tuple[Replica, Replica]
                                                       ) -> None:
    """Defect 3: an empty snapshot of a higher epoch made the primary step down and
    drop its state, leaving the shard without one."""
    primary, _ = pair
    after = _attack(primary.address, wrepl.Snapshot(99, 0, 0.0, "tcp://127.0.0.1:1", b"",
                                                    None, []))
    assert (after.role, after.epoch) == ("primary", 0)


def test_a_stranger_cannot_join_as_a_backup(pair: tuple[Replica, Replica]) -> None:
    """Defect 4: a join naming the stranger's own socket was sent the whole state, and
    the stranger counted as a backup every worker's answer waited for."""
    primary, backup = pair
    ctx = zmq.Context.instance()
    listener = ctx.socket(zmq.ROUTER)
    listener.setsockopt(zmq.LINGER, 0)
    try:
        mine = f"tcp://127.0.0.1:{listener.bind_to_random_port('tcp://127.0.0.1')}"
        after = _attack(primary.address, wrepl.Join(1, mine, "ab" * 8))
        assert after.role == "primary" and after.backups == [backup.address]
        assert not listener.poll(1000), "the primary sent the stranger its state"
    finally:
        listener.close(0)


def test_forged_keep_alives_do_not_hold_off_the_takeover(own_pair: tuple[Replica, Replica]
                                                         ) -> None:
    """Defect 2: keep-alives from a stranger every 0.2 s, after the primary died, held
    the backup's takeover off for as long as they came."""
    primary, backup = own_pair
    os.kill(primary.popen.pid, signal.SIGKILL)
    primary.popen.wait(LIMIT)
    deadline = time.monotonic() + LIMIT
    with _stranger(backup.address) as sock:
        while True:
            for frames in _forged(wrepl.Apply(0, 0, 0.0, "ping")):
                sock.send_multipart(frames)
            role = _role(sock)
            if role.role == "primary":
                break
            assert time.monotonic() < deadline, f"no takeover: still {role}"
            time.sleep(0.2)  # (the attack's own pace)
    assert role.epoch == 1


@pytest.mark.parametrize("backup_side", ["another key pair", "another key"])
def test_replicas_that_disagree_on_their_keys_say_so(tmp_path: Path, backup_side: str
                                                     ) -> None:
    """Defect 5: a backup with another key pair (or without CURVE) beside a CURVE
    primary left the primary never ready and silent; two replication keys likewise.
    Now the primary stops at once with one line naming both sides."""
    keys = generate_curve_keys(tmp_path / "keys")
    other = generate_curve_keys(tmp_path / "other")
    # (a backup without CURVE fails the same handshake: tests/test_replauth.py)
    curve = str(other.server_secret) if backup_side == "another key pair" else None
    mine = str(make_key_file(tmp_path / "mine.key"))
    theirs = str(make_key_file(tmp_path / "theirs.key"))
    backup = start("backup", replica_config(
        tmp_path, "backup", 1.0, replica=1, curve_secret_key=curve,
        replication_key=theirs if backup_side == "another key" else mine), tmp_path)
    try:
        began = time.monotonic()
        primary_curve = None if backup_side == "another key" else str(keys.server_secret)
        with pytest.raises(RuntimeError, match="did not start") as failed:
            start("primary", replica_config(
                tmp_path, "primary", 1.0, replica_peers=[backup.address],
                curve_secret_key=primary_curve, replication_key=mine), tmp_path)
        assert time.monotonic() - began < LIMIT
        said = str(failed.value)
        assert "do not agree" in said and backup.address in said, said
        if backup_side == "another key":  # each side names the other's key
            assert "another replication key" in backup.log.read_text()
    finally:
        backup.stop()

"""The pure rules of a replicated shard (paramserver/core/replica.py) and the bounds of
its wire records (paramserver/wire/replication.py): no sockets."""

from __future__ import annotations

import pytest

from paramserver.core.replica import ReplicaState, Role, Verdict
from paramserver.errors import ProtocolError
from paramserver.wire import replication as wrepl


def test_a_backup_applies_inputs_in_order_once():
    backup = ReplicaState.starting(1)
    assert backup.role is Role.BACKUP and not backup.writable
    assert backup.receive(0, 1, now=1.0) is Verdict.APPLY
    assert backup.receive(0, 1, now=1.1) is Verdict.AGAIN  # a resend: acknowledged only
    assert backup.receive(0, 3, now=1.2) is Verdict.GAP  # input 2 is missing
    assert backup.receive(0, 2, now=1.3) is Verdict.APPLY
    assert backup.receive(0, 0, now=1.4) is Verdict.AGAIN  # a keep-alive
    assert backup.applied == 2 and backup.heard_at == 1.4


def test_the_primary_numbers_its_inputs_and_a_backup_does_not_send():
    primary = ReplicaState.starting(0)
    assert primary.writable
    assert [primary.next_seq() for _ in range(3)] == [1, 2, 3]
    with pytest.raises(RuntimeError):
        ReplicaState.starting(1).next_seq()


def test_a_silent_primary_is_replaced_at_a_higher_epoch():
    backup = ReplicaState.starting(1)
    assert not backup.silent(99.0, timeout=1.5)  # no primary heard yet: still starting
    backup.receive(0, 1, now=1.0)
    assert not backup.silent(2.0, timeout=1.5)
    assert backup.silent(2.6, timeout=1.5)
    assert backup.promote() == 1
    assert backup.writable and backup.epoch == 1
    assert backup.next_seq() == 2  # numbering goes on from what it applied
    assert not backup.silent(99.0, timeout=1.5)  # a primary is never silent to itself


def test_fencing_a_promoted_backup_refuses_the_old_primary_which_steps_down():
    old = ReplicaState.starting(0)
    new = ReplicaState.starting(1)
    new.receive(old.epoch, old.next_seq(), now=0.5)
    new.promote()
    # the old primary was only paused: its next input carries epoch 0
    assert new.receive(old.epoch, old.next_seq(), now=5.0) is Verdict.STALE
    assert new.writable and new.applied == 1  # nothing of it applied
    assert not old.refused(0)  # a refusal at its own epoch does not fence
    assert old.refused(new.epoch)
    assert old.role is Role.FENCED and not old.writable
    with pytest.raises(RuntimeError):
        old.next_seq()
    assert old.receive(5, 1, now=6.0) is Verdict.STALE  # fenced for good


def test_two_primaries_of_one_epoch_cannot_be():
    primary = ReplicaState.starting(0)
    assert primary.receive(0, 1, now=1.0) is Verdict.STALE
    assert primary.writable


def test_a_fenced_or_new_replica_joins_by_snapshot_and_applies_only_after_it():
    old = ReplicaState.starting(0)
    with pytest.raises(RuntimeError):
        old.rejoin()  # a primary is fenced first
    old.next_seq()
    assert old.refused(1)
    old.rejoin()
    assert old.role is Role.JOINING and not old.writable
    assert old.receive(1, 5, now=1.0) is Verdict.HOLD  # no state to apply it to
    assert old.receive(1, 0, now=1.0) is Verdict.HOLD  # nor a keep-alive to answer
    assert not old.silent(99.0, timeout=1.0)  # it takes over from no one
    with pytest.raises(RuntimeError):
        old.promote()
    assert not old.joined(0, 4, now=2.0)  # a snapshot of a deposed primary
    assert old.role is Role.JOINING
    assert old.joined(1, 4, now=2.0)  # the snapshot at input 4 of epoch 1
    assert old.role is Role.BACKUP and old.applied == 4 and old.heard_at == 2.0
    assert not old.joined(1, 9, now=2.5)  # a second snapshot changes nothing
    assert old.receive(1, 4, now=3.0) is Verdict.AGAIN  # in the snapshot already
    assert old.receive(1, 5, now=3.1) is Verdict.APPLY
    # a process started in place of a dead backup joins the same way
    fresh = ReplicaState.starting(1)
    fresh.rejoin()
    assert fresh.receive(2, 1, now=1.0) is Verdict.HOLD and fresh.joined(2, 0, now=1.0)
    assert fresh.receive(2, 1, now=1.1) is Verdict.APPLY


def test_snapshot_records_round_trip_and_their_tensors_are_checked():
    import torch

    from paramserver.wire.frames import Limits

    join = wrepl.Join(1, "tcp://127.0.0.1:5000", "ab" * 8)
    assert wrepl.decode(wrepl.encode(join)) == (join, [])
    tensors = {"param/w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "optim/0/step": torch.tensor(3.0), "wait/0/w": torch.ones(2, dtype=torch.bfloat16)}
    frames = [bytes(f) for f in wrepl.snapshot_frames(2, 9, 1.5, "tcp://p", b"{}", None,
                                                      tensors, {3: "k" * 40})]
    record, rest = wrepl.decode(frames)
    assert isinstance(record, wrepl.Snapshot) and (record.epoch, record.seq) == (2, 9)
    assert record.owners == {3: "k" * 40}  # (CURVE: which key registered each worker)
    got = wrepl.snapshot_tensors(record, rest, Limits())
    assert got.keys() == tensors.keys()
    assert all(torch.equal(got[k], tensors[k]) and got[k].dtype == tensors[k].dtype
               for k in tensors)
    with pytest.raises(ProtocolError, match="frames came"):
        wrepl.snapshot_tensors(record, rest[:-1], Limits())
    with pytest.raises(ProtocolError, match="holds"):  # a frame of the wrong length
        wrepl.snapshot_tensors(record, [rest[0][:-4], *rest[1:]], Limits())
    bad = wrepl.Snapshot(2, 9, 1.5, "tcp://p", b"", None, [wrepl.TensorHead("x", "int99", [1])])
    with pytest.raises(ProtocolError):
        wrepl.snapshot_tensors(bad, [b"\0"], Limits())
    # only a snapshot may be larger than MAX_HEADER
    big = wrepl.Apply(1, 1, 0.0, "dead", list(range(5000)))
    with pytest.raises(ProtocolError, match="limit"):
        wrepl.decode(wrepl.encode(big))


def test_wire_records_round_trip_and_are_bounded():
    frames = [*wrepl.encode(wrepl.Apply(3, 7, 1.5, "msg")), b"payload"]
    assert wrepl.is_replication(frames)
    keyed = wrepl.Apply(3, 7, 1.5, "msg", key="k" * 40)
    assert wrepl.decode(wrepl.encode(keyed)) == (keyed, [])
    with pytest.raises(ProtocolError):  # a key is Z85 text of 40 characters, not more
        wrepl.decode(wrepl.encode(wrepl.Apply(3, 7, 1.5, "msg", key="k" * 65)))
    record, rest = wrepl.decode(frames)
    assert record == wrepl.Apply(3, 7, 1.5, "msg") and rest == [b"payload"]
    assert not wrepl.is_replication([b"\x82\xa2op"])  # a data header (a msgpack map)
    with pytest.raises(ProtocolError):
        wrepl.decode([wrepl.MAGIC, b"x" * (wrepl.MAX_HEADER + 1)])
    with pytest.raises(ProtocolError):
        wrepl.decode([wrepl.MAGIC, b"\xc1"])  # not msgpack
    with pytest.raises(ProtocolError):
        wrepl.decode([wrepl.MAGIC, wrepl.encode(wrepl.RoleReply("primary", 0, 0, 0,
                                                                 ["a"] * 17))[1]])


def test_what_does_not_work_yet_is_refused_in_one_line():
    from paramserver.errors import ConfigError
    from paramserver.server.config import ServerConfig
    from paramserver.workers.launch.clusterspec import ClusterSpec

    with pytest.raises(ConfigError, match="only --replicas 1 works"):
        ServerConfig(replicas=2)
    for policy in ("dc-asgd", "gap-aware"):  # the weights each worker read
        with pytest.raises(ConfigError, match=f"--policy {policy}: it rewrites gradients"):
            ServerConfig(policy=policy, replicas=1)
    with pytest.raises(ConfigError, match="ssp-adaptive: it sets the SSP bound"):
        ServerConfig(mode="ssp", policy="ssp-adaptive", replicas=1)
    # what replicates: backup workers, and policies that decide from each push alone
    ServerConfig(mode="sync", backup_workers=1, expected_workers=3, replicas=1)
    for policy in ("reject", "inverse", "exponential"):
        ServerConfig(policy=policy, replicas=1)
    with pytest.raises(ConfigError, match="--restart-servers"):
        ClusterSpec(server=ServerConfig(replicas=1), restart_servers=True)
    for mode in ("async", "sync", "ssp"):  # what works
        ServerConfig(mode=mode, replicas=1)


def test_the_server_command_checks_a_hand_started_replica():
    from click.testing import CliRunner

    from paramserver.cli.main import main

    def error(*args: str) -> str:
        result = CliRunner().invoke(main, ["server", *args])
        assert result.exit_code == 2 and "Traceback" not in result.output
        return result.output

    assert "replica 0 (the shard's first primary) needs --replica-peers" in error(
        "--replicas", "1")
    assert "--replica and --replica-peers need --replicas R" in error("--replica", "1")
    assert "--replica 2: a shard with --replicas 1 has replicas 0 .. 1" in error(
        "--replicas", "1", "--replica", "2")
    assert "--replica-peers: 2 addresses" in error(
        "--replicas", "1", "--replica-peers", "127.0.0.1:1,127.0.0.1:2")
    assert "is not an address" in error("--replicas", "1", "--replica-peers", "nowhere")


def test_a_replica_exports_its_role_epoch_inputs_and_failovers():
    """The Prometheus gauges of a backup before and after it takes over (no sockets: a
    backup has no backups of its own to connect to)."""
    from paramserver.observe.events import EventLog
    from paramserver.observe.metrics import MetricsRegistry
    from paramserver.server.config import ServerConfig
    from paramserver.server.replication import Replication

    class Host:
        core = None

    registry = MetricsRegistry()
    config = ServerConfig(shard=1, num_shards=2, replicas=1, replica=1)
    repl = Replication(Host(), config, EventLog(None), "tcp://b")  # type: ignore[arg-type]
    me = (1, 1)

    def gauges() -> tuple[float | None, ...]:
        return tuple(registry.get(f"paramserver_replica_{name}", me)
                     for name in ("primary", "epoch", "inputs", "failovers_total"))

    repl.state.receive(0, 1, now=10.0)
    repl.export(registry, now=10.0)
    assert gauges() == (0.0, 0.0, 1.0, 0.0)
    repl._take_over(13.0)
    repl.export(registry, now=10.1)  # within EXPORT_EVERY: not yet
    assert gauges() == (0.0, 0.0, 1.0, 0.0)
    repl.export(registry, now=13.0)
    assert gauges() == (1.0, 1.0, 1.0, 1.0)

"""The pure rules of a replicated shard (paramserver/core/replica.py) and the bounds of
its wire records (paramserver/wire/replication.py): no sockets."""

from __future__ import annotations

import pytest

from paramserver.core.replica import Candidate, ReplicaState, Role, Takeover, Verdict, elect
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
    assert old.receive(1, 4, now=3.0) is Verdict.AGAIN  # in the snapshot already
    assert old.receive(1, 5, now=3.1) is Verdict.APPLY
    assert not old.joined(1, 3, now=3.2)  # an older snapshot changes nothing
    # the primary dropped it and sent another at its input 9: it goes on from there
    assert old.joined(1, 9, now=3.2) and old.applied == 9
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
    # a keep-alive lists the primary and its backups: at most 16 addresses
    ping = wrepl.Apply(1, 0, 0.0, "ping", peers=["tcp://127.0.0.1:5001"] * 16)
    assert wrepl.decode(wrepl.encode(ping)) == (ping, [])
    with pytest.raises(ProtocolError):
        wrepl.decode(wrepl.encode(wrepl.Apply(1, 0, 0.0, "ping", peers=["a"] * 17)))


def test_what_does_not_work_yet_is_refused_in_one_line():
    from paramserver.errors import ConfigError
    from paramserver.server.config import ServerConfig
    from paramserver.workers.launch.clusterspec import ClusterSpec

    with pytest.raises(ConfigError, match="--replicas 5: at most 4 backups per shard"):
        ServerConfig(replicas=5)
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
        ServerConfig(mode=mode, replicas=4)


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


def test_a_replica_exports_its_role_epoch_inputs_and_failovers(tmp_path):
    """The Prometheus gauges of a backup before and after it takes over (no sockets: a
    backup has no backups of its own to connect to)."""
    from paramserver.observe.events import EventLog
    from paramserver.observe.metrics import MetricsRegistry
    from paramserver.server.config import ServerConfig
    from paramserver.server.replication import Replication

    class Host:
        core = None

    registry = MetricsRegistry()
    from paramserver.wire.replauth import make_key_file

    config = ServerConfig(shard=1, num_shards=2, replicas=1, replica=1,
                          replication_key=str(make_key_file(tmp_path / "replication.key")))
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


# --------------------------------------------------------------- several backups (elect)

def _c(replica: int, applied: int, epoch: int = 0, role: Role = Role.BACKUP) -> Candidate:
    return Candidate(role, epoch, applied, replica)


def test_elect_the_backup_holding_the_most_inputs_ties_to_the_lowest_index():
    # two backups time out together and ask each other: exactly one promotes
    for a, b, winner in ((_c(1, 7), _c(2, 7), 1), (_c(1, 6), _c(2, 7), 2),
                         (_c(1, 8), _c(2, 7), 1)):
        decisions = {a.replica: elect(a, [b]), b.replica: elect(b, [a])}
        assert decisions[winner] is Takeover.PROMOTE
        assert [d for r, d in decisions.items() if r != winner] == [Takeover.WAIT]
    # three backups, one of them (2) holding an input the others lack (forwarded, not
    # acknowledged): it wins; the others take its snapshot (takes_snapshot below)
    three = [_c(1, 5), _c(2, 6), _c(3, 5)]
    assert [elect(me, [p for p in three if p is not me]) for me in three] == [
        Takeover.WAIT, Takeover.PROMOTE, Takeover.WAIT]


def test_elect_alone_or_beside_replicas_that_hold_no_state():
    me = _c(2, 3)
    assert elect(me, []) is Takeover.PROMOTE  # the others are dead (no answer)
    # a joining replacement or a fenced old primary is no candidate, whatever it held
    assert elect(me, [_c(0, 9, role=Role.JOINING), _c(1, 9, role=Role.FENCED)]) \
        is Takeover.PROMOTE
    # a backup of an older epoch (not brought to ours yet) is no candidate either
    assert elect(_c(2, 3, epoch=1), [_c(0, 9, epoch=0)]) is Takeover.PROMOTE


def test_elect_waits_for_a_primary_that_answers_and_follows_a_newer_epoch():
    assert elect(_c(1, 3), [_c(0, 3, role=Role.PRIMARY)]) is Takeover.WAIT  # alive, slow
    # a rival already took over (or is bringing its backups to its state)
    assert elect(_c(1, 3), [_c(2, 2, epoch=2, role=Role.PRIMARY)]) is Takeover.FOLLOW
    assert elect(_c(1, 9), [_c(2, 2, epoch=2)]) is Takeover.FOLLOW


def test_two_backups_promoted_together_never_hold_one_epoch():
    """Should two candidates both promote (their answers differed: the old primary was
    still sending), their epochs differ: each replica's are its own modulo the shard's
    size, and the higher one's snapshot fences the lower one, never the reverse."""
    for size in (3, 4, 5):
        for start in range(0, 7):
            got = []
            for replica in range(1, size):
                r = ReplicaState(Role.BACKUP, epoch=start, replica=replica, size=size)
                got.append(r.promote())
                assert got[-1] > start and got[-1] % size == replica
            assert len(set(got)) == len(got)
    low = ReplicaState(Role.BACKUP, epoch=0, replica=1, size=3)
    high = ReplicaState(Role.BACKUP, epoch=0, replica=2, size=3)
    assert (low.promote(), high.promote()) == (1, 2)
    assert not high.takes_snapshot(1, 10) and low.takes_snapshot(2, 10)
    assert low.joined(2, 10, now=1.0) and low.role is Role.BACKUP and low.epoch == 2
    # with one backup a promotion is always the next epoch (what --replicas 1 did)
    one = ReplicaState.starting(0, size=2)
    one.role, one.epoch = Role.BACKUP, 1
    assert one.promote() == 2


def test_a_backup_holds_a_new_primarys_inputs_until_its_snapshot():
    """A backup of epoch 0 that may hold inputs the new primary lacks applies none of
    the new epoch's inputs (keep-alives neither) until the snapshot brings it to the
    new primary's input; then it goes on from there."""
    backup = ReplicaState.starting(2, size=3)
    assert backup.receive(0, 1, now=0.0) is Verdict.APPLY
    assert backup.receive(0, 2, now=0.1) is Verdict.APPLY  # the new primary lacks this one
    assert backup.receive(1, 0, now=1.5) is Verdict.HOLD and backup.epoch == 0
    assert backup.receive(1, 2, now=1.5) is Verdict.HOLD and backup.applied == 2
    assert backup.takes_snapshot(1, 1) and backup.joined(1, 1, now=1.6)
    assert (backup.applied, backup.epoch) == (1, 1)
    assert backup.receive(1, 2, now=1.7) is Verdict.APPLY  # its input 2, not the old one
    assert not backup.takes_snapshot(1, 1)  # an older snapshot changes nothing


def test_one_backup_writes_checkpoints_with_several():
    backup = ReplicaState(Role.BACKUP)
    assert backup.writes_checkpoints(0, rank=0)
    assert not backup.writes_checkpoints(0, rank=1)
    assert backup.writes_checkpoints(0, rank=None)  # not listed by the primary (yet)
    assert not ReplicaState(Role.PRIMARY).writes_checkpoints(2, rank=0)


def test_a_replica_0_started_in_place_of_a_dead_one_is_no_primary() -> None:
    """It would announce itself to the live primary and wait on it while that primary
    waits on the dead one's address: a replacement holds no state until it joined."""
    fresh = ReplicaState.starting(0, replacement=True)
    assert not fresh.writable
    fresh.rejoin()  # (a primary would raise here)
    assert fresh.receive(1, 5, 0.0) is Verdict.HOLD
    assert ReplicaState.starting(0).writable

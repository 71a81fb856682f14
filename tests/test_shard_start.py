"""A shard server is built without I/O and opened by one call (ShardServer.start);
what a failed start opened is closed again; Ready is the one signal that it listens;
the role a shard is given decides what a message does there (server/roles.py)."""

from __future__ import annotations

import socket

import pytest

from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.errors import ConfigError
from paramserver.observe.events import EventLog
from paramserver.persist.checkpoint import CheckpointError
from paramserver.server.checkpointer import Checkpointer
from paramserver.server.config import ServerConfig
from paramserver.server.loop import ShardServer
from paramserver.server.process import READY_PREFIX, Ready
from paramserver.server.replication import REPLAYED, Replication
from paramserver.server.roles import BACKUP, LONE, PRIMARY, Lone, Replicated, Route
from paramserver.server.shardstate import ShardState
from paramserver.wire.protocol import Op
from paramserver.wire.replauth import make_key_file
from tests.ports import free_port


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_building_a_shard_binds_nothing_and_claims_no_checkpoint_directory(tmp_path):
    port = free_port()
    ckpt = tmp_path / "ckpt"
    board = tmp_path / "tensorboard"
    log = tmp_path / "logs" / "server0.jsonl"
    server = ShardServer(ServerConfig(bind=f"tcp://127.0.0.1:{port}",
                                      checkpoint_dir=str(ckpt), tensorboard=str(board),
                                      event_log=str(log)))
    try:
        assert _port_free(port)  # no socket yet
        assert not ckpt.exists()  # nor a claim on the directory
        assert not board.exists()  # nor a TensorBoard writer
        assert not log.parent.exists()  # nor an event log (opened by its first record)
        ready = server.start()
        assert ready == Ready(f"tcp://127.0.0.1:{port}", None) == server.ready
        assert not _port_free(port) and board.exists()
        assert server.start() == ready  # once
    finally:
        server.close(linger=0)
    assert server.socket.socket.closed


def test_a_start_that_fails_closes_what_it_opened(tmp_path):
    port = free_port()
    bad = tmp_path / "resume"
    (bad / "shard0").mkdir(parents=True)  # a checkpoint directory with no checkpoint
    server = ShardServer(ServerConfig(bind=f"tcp://127.0.0.1:{port}", resume=str(bad)))
    with pytest.raises(CheckpointError):
        server.start()
    assert server.started and server.socket.socket.closed  # what it bound is closed again
    assert server.core is None


def test_ready_is_one_line_read_back_as_it_was_written():
    ready = Ready("tcp://127.0.0.1:5600", 9101, 42)
    assert ready.line() == f"{READY_PREFIX} tcp://127.0.0.1:5600 pid=42 metrics=9101"
    assert Ready.parse(ready.line()) == ready
    assert Ready.parse(Ready("tcp://h:1", None, 7).line()) == Ready("tcp://h:1", None, 7)
    with pytest.raises(ValueError, match="not a"):
        Ready.parse("Traceback (most recent call last):")


def test_a_role_decides_what_a_data_message_does(tmp_path):
    checkpoints = Checkpointer(0, None, EventLog(None))
    lone = Lone(checkpoints, lambda copy: None)
    assert lone.duties is LONE and lone.replication is None
    assert {lone.route(op, b"w") for op in Op} == {Route.APPLY}
    assert lone.settle(0) and lone.decided("dead", [1])

    class Host:
        core = None

    key = make_key_file(tmp_path / "replication.key")
    config = ServerConfig(replicas=1, replica=1, replication_key=str(key))
    repl = Replication(Host(), config, EventLog(None), "tcp://b")  # type: ignore[arg-type]
    role = Replicated(repl, checkpoints, lambda copy: None, None, first=False)  # type: ignore[arg-type]
    try:
        repl.state.receive(0, 1, now=10.0)  # a backup that heard its primary
        assert role.duties is BACKUP
        # a backup answers no worker, handles what its primary forwarded, and STATS
        assert role.route(Op.PUSH, b"w") is Route.DROP
        assert role.route(Op.PUSH, REPLAYED) is Route.APPLY
        assert role.route(Op.STATS, b"w") is Route.APPLY
        repl._take_over(13.0)  # promoted, no backup of its own yet
        assert role.duties is PRIMARY
        assert role.route(Op.PUSH, b"w") is Route.FORWARD
        assert role.route(Op.STATS, b"w") is Route.APPLY
    finally:
        role.close()


def test_a_state_goes_in_whole_or_leaves_no_half_restored_shard():
    """adopt_state (a checkpoint resumed, a replica's snapshot): a core built from the
    state's plan and loaded; a load that fails leaves no core, plan or tables."""
    plan = ShardPlan([ParamSpec("w", (4,), "float32")], 1)
    server = ShardServer(ServerConfig(bind="tcp://127.0.0.1:0"))
    server.start()
    try:
        def load(core, sparse):  # type: ignore[no-untyped-def]
            core.params["w"].fill_(2.0)

        server.adopt_state(ShardState(plan, {}, {1: "key"}, load))
        assert server.plan is plan and server.access.owners == {1: "key"}
        assert server.core is not None and server.core.params["w"].tolist() == [2.0] * 4

        def fails(core, sparse):  # type: ignore[no-untyped-def]
            raise ConfigError("the weights do not fit")

        with pytest.raises(ConfigError, match="do not fit"):
            server.adopt_state(ShardState(plan, {}, {}, fails))
        assert server.core is None and server.plan is None and server.sparse is None
        assert server.access.owners == {}
    finally:
        server.close()


def test_one_place_builds_a_shard_server_and_one_its_core():
    """entry.serve builds every shard server the project starts, and
    ServerConfig.new_core every core (a shard's and the simulator's): no other module
    calls either constructor (benchmarks/hotpath.py drives a handler in-process, on
    purpose)."""
    import os
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "paramserver"
    calls: dict[str, set[str]] = {"ShardServer": set(), "ShardCore": set()}
    # (workers/, cli/ and benchmarks/ are links inside the package: followed)
    paths = [Path(d) / f for d, _, files in os.walk(root, followlinks=True)
             for f in files if f.endswith(".py")]
    for path in paths:
        rel = path.relative_to(root).as_posix()
        for name in calls:
            if re.search(rf"(?<![\w.`~])(?<!class ){name}\(", path.read_text(encoding="utf-8")):
                calls[name].add(rel)
    assert calls["ShardServer"] == {"server/entry.py", "benchmarks/hotpath.py"}
    assert calls["ShardCore"] == {"server/config.py"}

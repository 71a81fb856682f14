"""CURVE identities bound to keys (issue 12): real shard processes over loopback.

A worker id belongs to the public key whose HELLO registered it; another
admitted key cannot act for it. SHUTDOWN, CHECKPOINT and BYE dead=true need an
admin key; STATS is open to any admitted key. Plus the allow-list parser.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq
from click.testing import CliRunner
from zmq.utils import z85

from paramserver.cli.keys import keys as keys_cli
from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.errors import ConfigError, TransportError
from paramserver.server.loop import ServerConfig
from paramserver.wire.curve import (
    ANY_KEY,
    CurveKeyFiles,
    CurveKeys,
    KeyGrant,
    generate_curve_keys,
    load_allow_list,
    parse_allow_list,
)
from paramserver.wire.protocol import PROTOCOL_VERSION
from paramserver.wire.stats import WorkerStats
from paramserver.workers.admin import server_stats
from paramserver.workers.client import PSClient
from paramserver.workers.launch.cluster import ClusterSpec, LocalCluster
from paramserver.workers.worker import WorkerConfig

PLAN = ShardPlan([ParamSpec("w", (32,), "float32")], 1)


class Peer:
    """A raw CURVE DEALER speaking the wire format by hand, with one key pair."""

    def __init__(self, address: str, keys: CurveKeys) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.curve_secretkey, self.sock.curve_publickey = keys.secret, keys.public
        assert keys.server_public is not None
        self.sock.curve_serverkey = keys.server_public
        self.sock.connect(address)
        self.seq = 0

    def ask(self, op: str, fields: dict[str, Any],
            tensors: list[tuple[str, bytes]] = ()) -> dict[str, Any]:
        self.seq += 1
        header = {"v": PROTOCOL_VERSION, "op": op, "seq": self.seq, "f": fields,
                  "t": [[k, "float32", [len(b) // 4]] for k, b in tensors]}
        self.sock.send_multipart([msgpack.packb(header), *[b for _, b in tensors]])
        assert self.sock.poll(20_000), f"no answer to {op}"
        head: dict[str, Any] = msgpack.unpackb(self.sock.recv_multipart()[0], raw=False)
        assert head["seq"] == self.seq
        return head

    def code(self, op: str, fields: dict[str, Any],
             tensors: list[tuple[str, bytes]] = ()) -> str:
        head = self.ask(op, fields, tensors)
        return str(head["f"]["code"]) if head["op"] == "error" else "ok"

    def hello(self, worker: int) -> str:
        return self.code("hello", {"worker": worker, "role": "worker",
                                   "protocol": PROTOCOL_VERSION, "plan_hash": PLAN.hash,
                                   "plan": PLAN.describe(), "incarnation": f"p{worker}"})

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _keys(made: CurveKeyFiles, name: str) -> CurveKeys:
    pair = made.clients.get(name) or made.admins[name]
    return CurveKeys.load(pair[1], made.server_public)


def _cluster(tmp_path: Path, made: CurveKeyFiles, **server: Any) -> LocalCluster:
    spec = ClusterSpec(
        num_servers=1, num_workers=1, evaluate=False,
        server=ServerConfig(mode="async", curve_secret_key=str(made.server_secret), **server),
        worker=WorkerConfig(curve_key=str(made.clients["a"][1]),
                            curve_server_key=str(made.server_public)))
    return LocalCluster(spec, tmp_path / "run")


def _worker0(address: str, keys: CurveKeys) -> WorkerStats:
    return server_stats([address], curve=keys)[0].workers["0"]


@pytest.mark.integration
def test_another_key_cannot_act_as_a_registered_worker(tmp_path: Path) -> None:
    made = generate_curve_keys(tmp_path / "keys", ["a", "b"], admins=["op"])
    a, b, op = _keys(made, "a"), _keys(made, "b"), _keys(made, "op")
    with _cluster(tmp_path, made, curve_clients_dir=str(made.authorized_dir),
                  admin_keys=[str(made.admins["op"][0])]) as cluster:
        (address,) = cluster.start_servers()
        proc = cluster.servers[0].popen
        params = {"w": torch.linspace(-1, 1, 32)}
        owner = PSClient([address], PLAN, worker=0, heartbeat_interval=0, timeout=20, curve=a)
        other = Peer(address, b)
        try:
            owner.connect()
            owner.initialize(params)
            pulled = owner.pull(params, 0)
            assert owner.push({"w": torch.full((32,), 0.1)}, pulled.versions, 4, 0).accepted
            version = server_stats([address], curve=a)[0].version
            before = _worker0(address, a)
            assert before.clock == 1 and before.live and before.applied == 1

            grad = [("w", torch.full((32,), 100.0).numpy().tobytes())]
            push = {"worker": 0, "push_id": 2, "clock": 1, "read_version": version,
                    "num_samples": 4}
            # b is admitted (STATS works) but may not act for worker 0 in any way
            assert other.code("stats", {}) == "ok"
            assert other.code("push", push, grad) == "forbidden"
            assert other.code("heartbeat", {"worker": 0}) == "forbidden"
            assert other.code("bye", {"worker": 0}) == "forbidden"
            assert other.code("init", {"worker": 0}, grad) == "forbidden"
            assert other.code("pull", {"worker": 0, "clock": 1}) == "forbidden"
            assert other.hello(0) == "forbidden"  # nor take the id over by registering
            # administrative operations need an admin key
            assert other.code("bye", {"worker": 0, "dead": True}) == "forbidden"
            assert other.code("checkpoint", {}) == "forbidden"
            assert other.code("shutdown", {}) == "forbidden"
            refused = other.ask("shutdown", {})["f"]["reason"]
            assert "admin" in refused

            stats = server_stats([address], curve=b)[0]
            assert stats.version == version
            after = _worker0(address, b)
            assert (after.clock, after.live, after.pushes, after.applied) == (
                before.clock, True, before.pushes, before.applied)
            assert stats.counters["error_forbidden"] == 10
            # b's own id is b's; the owner still trains
            assert other.hello(1) == "ok"
            pulled = owner.pull(params, 1)
            assert owner.push({"w": torch.full((32,), 0.1)}, pulled.versions, 4, 1).accepted
            assert server_stats([address], curve=b)[0].version == version + 1
            assert proc.poll() is None
        finally:
            owner.close()
            other.close()
        admin = Peer(address, op)
        try:
            dead = admin.ask("bye", {"worker": 1, "dead": True})
            assert dead["op"] == "reply" and dead["f"]["dead"] is True
            assert admin.code("shutdown", {}) == "ok"
        finally:
            admin.close()
        assert proc.wait(timeout=30) == 0


@pytest.mark.integration
def test_allow_list_binds_keys_to_ranks_and_the_admin_role(tmp_path: Path) -> None:
    made = generate_curve_keys(tmp_path / "keys", ["a", "b"], admins=["op"])
    allow = made.server_public.parent / "allow-list"
    op_public = made.admins["op"][0].read_bytes().decode()
    op_z85 = next(line.split('"')[1] for line in op_public.splitlines() if "public-key" in line)
    allow.write_text(f"# who may connect\n"
                     f"a.key rank=0\n"
                     f"b.key  # any free worker id\n"
                     f"{op_z85} role=admin\n")
    with _cluster(tmp_path, made, curve_clients_dir=str(allow),
                  checkpoint_dir=str(tmp_path / "ckpt")) as cluster:
        (address,) = cluster.start_servers()
        proc = cluster.servers[0].popen
        a, b, op = Peer(address, _keys(made, "a")), Peer(address, _keys(made, "b")), None
        try:
            assert a.hello(1) == "forbidden"  # a is rank 0 only
            assert a.hello(0) == "ok"
            assert b.hello(1) == "ok"
            assert a.code("checkpoint", {}) == "forbidden"
            op = Peer(address, _keys(made, "op"))
            assert op.code("stats", {}) == "ok"
            assert op.code("checkpoint", {}) == "ok"
            assert op.code("shutdown", {}) == "ok"
        finally:
            for peer in (a, b, op):
                if peer is not None:
                    peer.close()
        assert proc.wait(timeout=30) == 0


@pytest.mark.integration
def test_without_an_admin_key_nobody_can_shut_down_over_curve(tmp_path: Path) -> None:
    """No allow-list, no --admin-key: any key gets in, none may SHUTDOWN (the launcher's
    own key, made in the run directory, still can)."""
    made = generate_curve_keys(tmp_path / "keys", ["a", "b"])
    with _cluster(tmp_path, made) as cluster:
        (address,) = cluster.start_servers()
        proc = cluster.servers[0].popen
        b = Peer(address, _keys(made, "b"))
        try:
            assert b.hello(3) == "ok"
            assert b.code("shutdown", {}) == "forbidden"
            assert b.code("bye", {"worker": 3, "dead": True}) == "forbidden"
            assert b.code("bye", {"worker": 3}) == "ok"  # a worker may leave as itself
        finally:
            b.close()
        assert proc.poll() is None
        launcher = cluster.spec.admin_curve()
        assert launcher is not None and launcher.public != _keys(made, "a").public
        admin = Peer(address, launcher)
        try:
            assert admin.code("shutdown", {}) == "ok"
        finally:
            admin.close()
        assert proc.wait(timeout=30) == 0


# ---------------------------------------------------------------------------- allow-list

Z85_A = zmq.curve_keypair()[0].decode()
Z85_B = zmq.curve_keypair()[0].decode()
# Z85 has "#" (never a key's first character): this key ends with one
Z85_HASH = z85.encode(bytes(28) + (84).to_bytes(4, "big")).decode()


def test_allow_list_lines(tmp_path: Path) -> None:
    made = generate_curve_keys(tmp_path, ["w0"])
    w0 = CurveKeys.load(made.clients["w0"][1]).public.decode()
    text = (f"# comment\n\n{Z85_A}\n"
            f"{Z85_B} rank=2,3 role=admin  # both\n"
            f"w0.key role=worker rank=0\n"
            f"  {Z85_HASH} rank=7 #rank=8\n")
    grants = parse_allow_list(text, tmp_path)
    assert Z85_HASH.endswith("#")
    assert grants == {Z85_A: ANY_KEY, Z85_B: KeyGrant(frozenset({2, 3}), True),
                      w0: KeyGrant(frozenset({0}), False), Z85_HASH: KeyGrant(frozenset({7}))}
    # the old format, a directory of .key files: any worker id, no admin
    assert load_allow_list(made.authorized_dir) == {w0: ANY_KEY}
    (tmp_path / "list").write_text(f"{Z85_A} role=admin\n")
    assert load_allow_list(tmp_path / "list") == {Z85_A: KeyGrant(None, True)}


@pytest.mark.parametrize("line, error", [
    (f"{Z85_A} rank=", "rank="),
    (f"{Z85_A} rank=x", "rank="),
    (f"{Z85_A} rank=-1", "rank="),
    (f"{Z85_A} role=root", "unknown"),
    (f"{Z85_A} admin", "unknown"),
    (f"{Z85_A} rank=1 rank=2", "unknown"),
    ("nosuch.key", "neither a Z85"),
    (f"{Z85_A}\n{Z85_A} role=admin", "listed twice"),
], ids=lambda v: v.replace(Z85_A, "KEY"))  # the key is fresh per process: ids must agree
def test_allow_list_refuses_bad_lines(tmp_path: Path, line: str, error: str) -> None:
    with pytest.raises(TransportError, match=error):
        parse_allow_list(line, tmp_path, "list")


def test_an_empty_allow_list_and_admin_keys_without_curve_are_refused(tmp_path: Path) -> None:
    (tmp_path / "list").write_text("# nobody\n")
    with pytest.raises(TransportError, match="no client public keys"):
        load_allow_list(tmp_path / "list")
    with pytest.raises(ConfigError, match="admin_keys need curve_secret_key"):
        ServerConfig(admin_keys=[Z85_A])


def test_keys_cli_makes_an_admin_pair_outside_the_authorised_dir(tmp_path: Path) -> None:
    out = CliRunner().invoke(keys_cli, ["generate", str(tmp_path), "--client", "w0",
                                        "--admin", "op"])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "op.key_secret").exists() and (tmp_path / "op.key").exists()
    assert sorted(p.name for p in (tmp_path / "authorized_clients").iterdir()) == ["w0.key"]
    assert "--admin-key" in out.output and "op.key" in out.output
    with pytest.raises(TransportError, match="repeat"):
        generate_curve_keys(tmp_path / "again", ["op"], admins=["op"])

"""Modes and policies over real shard and worker processes on loopback."""

from __future__ import annotations

import pytest
import torch
import zmq

from paramserver.core.sharding import ShardPlan
from paramserver.errors import IncompatiblePlanError
from paramserver.observe.events import read_events
from paramserver.server.loop import ServerConfig
from paramserver.wire.protocol import PROTOCOL_VERSION, Message, Op
from paramserver.wire.transport import Channel
from paramserver.workers.launch.cluster import ClusterSpec, LocalCluster, run_cluster
from paramserver.workers.stragglers import StragglerSpec
from paramserver.workers.worker import WorkerConfig

pytestmark = pytest.mark.integration


def spec(mode="async", workers=3, steps=40, **server):
    return ClusterSpec(
        num_servers=2, num_workers=workers,
        server=ServerConfig(mode=mode, **server),
        worker=WorkerConfig(servers=[], task="digits-mlp", steps=steps,
                            straggler=StragglerSpec(min_step_time=0.01)),
    )


def test_ssp_bound_holds_with_a_5x_straggler(tmp_path):
    s = spec("ssp", workers=3, steps=30, staleness_bound=2)
    s.stragglers = {0: StragglerSpec(min_step_time=0.01, slowdown=5.0)}
    result = run_cluster(s, tmp_path)
    for shard in result.servers:
        assert shard["max_answered_gap"] <= 2
        fast = [shard["workers"][w] for w in ("1", "2")]
        assert all(w["deferred_pulls"] > 0 and w["wait_seconds"] > 0 for w in fast)
    # the worker logs agree: no worker ever started an iteration more than s ahead
    steps = {r: read_events(tmp_path / "events" / f"worker{r}.jsonl", "step") for r in range(3)}
    assert all(len(v) == 30 for v in steps.values())


def test_reject_policy_accounts_for_every_push(tmp_path):
    s = spec("async", workers=4, steps=25, policy="reject", policy_args={"max_staleness": 0})
    result = run_cluster(s, tmp_path)
    total_rejected = 0
    for shard in result.servers:
        for w in shard["workers"].values():
            rejected = sum(w["rejected"].values())
            assert w["pushes"] == 25 == w["applied"] + rejected
            total_rejected += rejected
        assert shard["version"] == sum(w["applied"] for w in shard["workers"].values())
    assert total_rejected > 0
    pushes = read_events(tmp_path / "events" / "server0.jsonl", "push")
    assert len(pushes) == 100
    assert all(p["staleness"] > 0 for p in pushes if not p["accepted"])


def test_custom_policy_changes_what_is_applied(tmp_path):
    s = spec("async", workers=2, steps=10,
             policy="tests.policies_fixture:OnlyWorker", policy_args={"worker": 1})
    result = run_cluster(s, tmp_path)
    for shard in result.servers:
        assert shard["workers"]["1"]["applied"] == 10
        assert shard["workers"]["0"]["applied"] == 0
        assert shard["workers"]["0"]["rejected"] == {"not worker 1": 10}
        assert shard["version"] == 10
    assert result.workers[0].rejected == 10


def test_server_refuses_bad_peers_and_keeps_serving(tmp_path):
    s = spec("async", workers=1, steps=5)
    with LocalCluster(s, tmp_path) as cluster:
        addresses = cluster.start_servers()
        # garbage and wrong-plan workers get ERROR replies, not a dead server
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.connect(addresses[0])
        raw.send_multipart([b"\x00garbage", b"x"])
        assert raw.poll(10000)
        reply = raw.recv_multipart()
        raw.close(0)
        assert b"bad_header" in reply[0]

        wrong = ShardPlan.from_module(torch.nn.Linear(3, 2), num_shards=3)
        ch = Channel(addresses[0], peer="shard 0")
        try:
            hello = Message(Op.HELLO, 0, {"worker": 0, "role": "worker",
                                          "protocol": PROTOCOL_VERSION,
                                          "plan_hash": wrong.hash, "plan": wrong.describe(),
                                          "incarnation": "x"})
            with pytest.raises(IncompatiblePlanError,
                               match="3 shards; this server is shard 0 of 2"):
                ch.request(hello, 10)
        finally:
            ch.close()
        cluster.start_workers()
        cluster.wait_workers()
        # the server now holds digits-mlp's plan: another model is refused, saying why
        other = ShardPlan.from_module(torch.nn.Sequential(torch.nn.Linear(64, 32),
                                                          torch.nn.Linear(32, 10)), 2)
        ch = Channel(addresses[1], peer="shard 1")
        try:
            hello = Message(Op.HELLO, 0, {"worker": 5, "role": "worker",
                                          "protocol": PROTOCOL_VERSION,
                                          "plan_hash": other.hash, "plan": other.describe(),
                                          "incarnation": "y"})
            with pytest.raises(IncompatiblePlanError,
                               match=r"model or shard layout differs.*shape"):
                ch.request(hello, 10)
        finally:
            ch.close()
    worker = read_events(tmp_path / "events" / "worker0.jsonl", "worker_end")[0]
    assert worker["steps"] == 5

"""A small model's pushes and pulls through SmallShare, over real shard processes on
loopback: the same weights, bit for bit, as the general path, in every mode, and
the lane really taken."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paramserver.core.sharding import ShardPlan
from paramserver.server.loop import ServerConfig
from paramserver.wire import lanes
from paramserver.workers.admin import server_stats
from paramserver.workers.client import PSClient
from paramserver.workers.launch.cluster import ClusterSpec, LocalCluster
from paramserver.workers.worker import WorkerConfig

pytestmark = pytest.mark.integration

STEPS = 8


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _run(tmp_path: Path, mode: str, shards: int) -> tuple[dict[str, torch.Tensor], list[dict]]:
    spec = ClusterSpec(
        num_servers=shards, num_workers=1,
        server=ServerConfig(mode=mode, optimizer="sgd", optimizer_args={"lr": 0.1},
                            heartbeat_timeout=30),
        worker=WorkerConfig(servers=[], task="digits-mlp"), evaluate=False)
    model = _model()
    params = dict(model.named_parameters())
    plan = ShardPlan.from_module(model, shards)
    with LocalCluster(spec, tmp_path) as cluster:
        addresses = cluster.start_servers()
        with PSClient(addresses, plan, 0, timeout=30) as client:
            clock = client.connect()
            client.initialize(params)
            versions = client.pull(params, clock).versions
            for step in range(STEPS):
                gen = torch.Generator().manual_seed(step)
                grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
                if step % 2:
                    pushed = client.push(grads, versions, 2, clock + step)
                    pulled = client.pull(params, clock + step + 1)
                else:
                    pushed, pulled = client.push_pull(grads, versions, 2, clock + step, params)
                assert pushed.accepted
                versions = pulled.versions
            client.bye()
        stats = server_stats(addresses)
    return {n: p.detach().clone() for n, p in params.items()}, stats


@pytest.mark.parametrize(("mode", "shards"), [("async", 1), ("sync", 2), ("ssp", 3)])
def test_the_lane_gives_the_general_paths_weights(tmp_path: Path, mode: str, shards: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    packed, landed = [], []
    pack, land = lanes.SmallShare.pack, lanes.SmallShare.land

    def counted_pack(self: lanes.SmallShare, grads: dict) -> object:
        packed.append(1)
        return pack(self, grads)

    def counted_land(self: lanes.SmallShare, params: dict, tensors: dict) -> bool:
        ok = land(self, params, tensors)
        landed.append(ok)
        return ok

    monkeypatch.setattr(lanes.SmallShare, "pack", counted_pack)
    monkeypatch.setattr(lanes.SmallShare, "land", counted_land)
    fast, fast_stats = _run(tmp_path / "lane", mode, shards)
    assert len(packed) == STEPS * shards  # every push, to every shard
    assert len(landed) >= STEPS * shards and all(landed)  # every pull (and the first)

    monkeypatch.setattr(lanes.SmallShare, "of", classmethod(lambda cls, plan, shard: None))
    slow, slow_stats = _run(tmp_path / "general", mode, shards)
    for name, value in slow.items():
        assert torch.equal(fast[name], value), name
    assert not torch.equal(fast["0.weight"], dict(_model().named_parameters())["0.weight"])
    for a, b in zip(fast_stats, slow_stats, strict=True):
        assert a.version == b.version > 0

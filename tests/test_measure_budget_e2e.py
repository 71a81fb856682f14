"""A real shard keeps measuring pushes within its ``--observe`` budget (STATS says how)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.observe.watchdog import WatchdogConfig
from paramserver.server.loop import ServerConfig
from paramserver.workers.admin import server_stats
from paramserver.workers.client import PSClient
from paramserver.workers.launch.cluster import ClusterSpec, LocalCluster
from paramserver.workers.worker import WorkerConfig

pytestmark = pytest.mark.integration


def _level_after_pushes(tmp_path: Path, observe: str, pushes: int) -> list[int]:
    """Push a small model ``pushes`` times (stopping early once the level moved);
    the levels STATS reported along the way."""
    spec = ClusterSpec(num_servers=1, num_workers=1,
                       server=ServerConfig(mode="async", optimizer="sgd",
                                           optimizer_args={"lr": 1e-3},
                                           observe=observe),
                       worker=WorkerConfig(servers=[], task="digits-mlp"), evaluate=False)
    plan = ShardPlan([ParamSpec("w", (256,), "float32")], 1)
    params = {"w": torch.zeros(256)}
    grads = {"w": torch.full((256,), 1e-3)}
    levels = []
    with LocalCluster(spec, tmp_path) as cluster:
        addresses = cluster.start_servers()
        with PSClient(addresses, plan, 0, timeout=30) as client:
            clock = client.connect()
            client.initialize(params)
            versions = client.pull(params, clock).versions
            deadline = time.monotonic() + 60
            for i in range(pushes):
                _, pulled = client.push_pull(grads, versions, 1, clock + i, params)
                versions = pulled.versions
                if i % 100 == 99:
                    levels.append(server_stats(addresses)[0].measured_one_in)
                    if levels[-1] > 1 or time.monotonic() > deadline:
                        break
            client.bye()
    return levels


def test_a_shard_over_its_measuring_budget_samples_pushes(tmp_path: Path) -> None:
    # a budget no measurement fits in: the level doubles every 0.25 s window
    levels = _level_after_pushes(tmp_path, "budget:1e-9", 20_000)
    assert levels[-1] > 1, levels


def test_observe_every_measures_every_push(tmp_path: Path) -> None:
    # what the default was before issue 34 (a budget of 5 % now: WatchdogConfig)
    assert WatchdogConfig().observe_budget == 0.05
    assert ServerConfig(observe="every").watchdog_config().observe_budget == 0.0
    levels = _level_after_pushes(tmp_path, "every", 600)
    assert levels == [1] * 6

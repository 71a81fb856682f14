"""Plans that would cost a shard more than they declare (issue 29, item 2), against
real shard processes: what a plan costs in all (every copy of the weights, sparse
rows with their ids and versions, optimizer state) is held to --max-model-bytes,
a HELLO's plan costs memory only once its weights are seeded, and --plan-hash pins
the one plan a shard accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.errors import ConfigError
from paramserver.server.loop import ServerConfig
from paramserver.sparse.shard import TableSpec
from paramserver.workers.admin import server_stats
from tests.test_hostile_e2e import PLAN, Hostile, Legit, _cluster, _rss

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MiB = 1 << 20


def _dense(nbytes: int) -> ShardPlan:
    return ShardPlan([ParamSpec("x", (nbytes // 4,), "float32")], 1)


def _table(rows: int, dim: int, init: str = "normal") -> ShardPlan:
    return ShardPlan([ParamSpec("w", (4,), "float32")], 1,
                     sparse=[TableSpec("emb", rows, dim, "float32", init)])


def test_a_hellos_plan_costs_no_memory_until_its_weights_are_seeded(tmp_path: Path) -> None:
    """A 1 GiB dense parameter and a 512 MiB table in one HELLO: adopted (within the
    default 4 GiB), and the shard's resident set does not grow by them."""
    with _cluster(tmp_path) as cluster:
        (address,) = cluster.start_servers()
        pid = cluster.servers[0].popen.pid
        bad = Hostile(address)
        try:
            rss0 = _rss(pid)
            plan = ShardPlan([ParamSpec("x", (1 << 28,), "float32")], 1,
                             sparse=[TableSpec("emb", 1 << 21, 64, "float32")])
            assert bad.hello(1, plan) == "ok"
            stats = server_stats([address])[0]
            grown = _rss(pid) - rss0
            assert grown < 64 * MiB, f"the shard grew by {grown >> 20} MiB"
            assert stats.sparse.built is False
            assert not stats.initialized
            assert cluster.servers[0].popen.poll() is None
        finally:
            bad.close()


def test_every_byte_a_plan_costs_counts_against_the_limit(tmp_path: Path) -> None:
    """A table whose values fit the limit but whose ids and versions do not; weights
    and a table each within it but not together; weights whose Adam state does not
    fit: refused before anything is built, and a plan that fits still trains."""
    with _cluster(tmp_path, max_model_bytes=64 * MiB, optimizer="adam",
                  optimizer_args={"lr": 0.01}) as cluster:
        (address,) = cluster.start_servers()
        pid = cluster.servers[0].popen.pid
        bad = Hostile(address)
        try:
            rss0 = _rss(pid)
            # 64 MiB of values at dim 1; its ids and versions are 256 MiB more
            assert bad.hello(1, _table(16 * MiB, 1)) == "bad_field"
            # 16 MiB of weights, 48 MiB with Adam's two moments, and an 8 MiB table,
            # 28 MiB with its moments, ids and versions: each fits, not both
            both = ShardPlan([ParamSpec("x", (4 * MiB,), "float32")], 1,
                             sparse=[TableSpec("emb", 1 << 18, 8, "float32")])
            assert bad.hello(1, both) == "bad_field"
            assert bad.hello(1, _dense(32 * MiB)) == "bad_field"  # 96 MiB with Adam
            assert server_stats([address])[0].initialized is False
            assert _rss(pid) - rss0 < 32 * MiB
            legit = Legit(address)
            try:
                legit.seed()
                assert legit.step().accepted
            finally:
                legit.close()
        finally:
            bad.close()


def test_plan_hash_pins_the_plan_a_fresh_shard_accepts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="plan_hash"):
        ServerConfig(plan_hash="not-a-hash")
    with _cluster(tmp_path, plan_hash=PLAN.hash) as cluster:
        (address,) = cluster.start_servers()
        bad = Hostile(address)
        try:
            # the first HELLO brings another (valid, small) plan: refused, not adopted
            other = ShardPlan([ParamSpec("x", (4,), "float32")], 1)
            assert bad.hello(1, other) == "plan_mismatch"
            assert server_stats([address])[0].workers == {}
            legit = Legit(address)
            try:
                legit.seed()
                assert legit.step().accepted
                params = {"w": torch.zeros(128), "b": torch.zeros(16)}
                legit.client.pull(params)
                assert torch.isfinite(params["w"]).all()
            finally:
                legit.close()
        finally:
            bad.close()

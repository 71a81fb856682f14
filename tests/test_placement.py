"""Where `paramserver run --replicas R` places each shard's replicas (no sockets): a
shard's replicas on different nodes whenever no node holds more server ranks than there
are shards, and rank order on one node."""

from __future__ import annotations

from collections import Counter

import pytest

from paramserver.errors import ConfigError
from paramserver.workers.launch.placement import Placement, place_replicas
from paramserver.workers.launch.rendezvous import assign_role


def _check(nodes: list[str], shards: int, replicas: int) -> list[Placement]:
    placed = place_replicas(nodes, shards, replicas)
    # every (shard, replica) exactly once
    assert sorted((p.shard, p.replica) for p in placed) == [
        (s, r) for s in range(shards) for r in range(1 + replicas)]
    return placed


def _nodes_of_shard(nodes: list[str], placed: list[Placement], shard: int) -> list[str]:
    return [nodes[k] for k, p in enumerate(placed) if p.shard == shard]


def test_one_node_is_rank_order():
    placed = _check(["a"] * 6, 3, 1)
    assert [(p.shard, p.replica) for p in placed] == [(0, 0), (1, 0), (2, 0),
                                                      (0, 1), (1, 1), (2, 1)]


@pytest.mark.parametrize(("nodes", "shards", "replicas"), [
    (["a", "a", "b", "b"], 2, 1),  # torchrun: 2 nodes, 2 server ranks each
    (["a", "b", "a", "b"], 2, 1),  # Slurm's cyclic distribution
    (["a", "a", "a", "b", "b", "b"], 3, 1),
    (["a", "b", "c"], 1, 2),  # one shard, three nodes
    (["a", "a", "b", "b", "c", "c"], 2, 2),
    (["a", "a", "b", "c"], 2, 1),  # uneven nodes
    (["a", "b"], 1, 1),
])
def test_a_shards_replicas_land_on_different_nodes(nodes, shards, replicas):
    placed = _check(nodes, shards, replicas)
    for shard in range(shards):
        on = _nodes_of_shard(nodes, placed, shard)
        assert len(set(on)) == len(on), (shard, on)


def test_a_node_with_more_ranks_than_shards_shares_only_what_it_must():
    # node a holds 3 server ranks for 2 shards: one shard has 2 replicas there, no more
    nodes = ["a", "a", "a", "b"]
    placed = _check(nodes, 2, 1)
    shared = [s for s in range(2)
              if max(Counter(_nodes_of_shard(nodes, placed, s)).values()) > 1]
    assert len(shared) == 1


def test_bad_counts_are_refused():
    with pytest.raises(ConfigError, match="3 server ranks cannot hold 2 shard"):
        place_replicas(["a", "b", "c"], 2, 1)


def test_the_first_ranks_are_servers_with_their_replicas():
    assert assign_role(3, 6, 2, replicas=1).kind == "server"
    role = assign_role(4, 6, 2, replicas=1)
    assert (role.kind, role.index, role.num_workers) == ("worker", 0, 2)
    with pytest.raises(ConfigError, match=r"4 processes cannot hold 2 server\(s\) x 2 replicas"):
        assign_role(0, 4, 2, replicas=1)

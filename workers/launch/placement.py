"""Which shard and replica each server rank of ``paramserver run --replicas R`` is.

A pure function of the nodes the server ranks run on (no I/O): the rendezvous store
gathers each server rank's node name (paramserver/workers/launch/rendezvous.py), and
every server rank then computes the same placement.

The rule: list the server ranks node by node (nodes in order of their first rank,
ranks ascending within a node), and give the i-th of that list shard ``i % S``,
replica ``i // S``. A node's ranks are consecutive in the list, so a node with at
most S server ranks holds at most one replica of any shard: a shard's replicas share
a node only when some node holds more than S server ranks, and then some shard must
(pigeonhole). On one node the placement is rank order: ranks 0 .. S-1 are the
primaries of shards 0 .. S-1, as without replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from paramserver.errors import ConfigError

__all__ = ["Placement", "place_replicas"]


@dataclass(frozen=True)
class Placement:
    """One server rank's shard and replica (0: it starts as the shard's primary)."""

    shard: int
    replica: int


def place_replicas(nodes: Sequence[str], num_shards: int, replicas: int) -> list[Placement]:
    """The placement of each server rank, given the node each one runs on (by rank:
    ``nodes[k]`` is server rank k's node)."""
    if num_shards < 1 or replicas < 0:
        raise ConfigError(f"place_replicas: {num_shards} shards with {replicas} replicas")
    if len(nodes) != num_shards * (1 + replicas):
        raise ConfigError(f"{len(nodes)} server ranks cannot hold {num_shards} shard(s) x "
                          f"{1 + replicas} replica(s)")
    order: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        order.setdefault(node, []).append(rank)
    out: list[Placement | None] = [None] * len(nodes)
    listed = [rank for ranks in order.values() for rank in ranks]
    for i, rank in enumerate(listed):
        out[rank] = Placement(shard=i % num_shards, replica=i // num_shards)
    return [p for p in out if p is not None]

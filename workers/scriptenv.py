"""What a script's process takes from its launcher, apart from the optimizer itself:
the shards' addresses and its rank from the environment ``paramserver launch --
COMMAND``, ``paramserver run`` and torchrun set, a ``DistributedSampler`` that reads
them, and the plan file by which a launcher saves the servers' final weights."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from paramserver.core.sharding import ParamSpec, ShardPlan, dtype_name
from paramserver.sparse.shard import TableSpec
from paramserver.workers.clientconfig import (
    EVENT_LOG_ENV,
    PLAN_FILE_ENV,
    RESULT_FILE_ENV,
    SERVERS_ENV,
    int_from_env,
    servers_from_env,
)

__all__ = ["EVENT_LOG_ENV", "PLAN_FILE_ENV", "RESULT_FILE_ENV", "SERVERS_ENV",
           "DistributedSampler", "int_from_env", "make_plan", "read_plan", "servers_from_env"]


class DistributedSampler(torch.utils.data.distributed.DistributedSampler):
    """torch's ``DistributedSampler`` for the ranks of a paramserver run, which have no
    process group: ``num_replicas`` and ``rank`` default to ``WORLD_SIZE`` and ``RANK``
    (``paramserver launch -- COMMAND`` and ``paramserver run -- COMMAND`` set them, and
    so does torchrun) instead of raising "Default process group has not been
    initialized". With a process group, torch's own defaults apply. The rest
    (``shuffle``, ``seed``, ``drop_last``, ``set_epoch``) is torch's."""

    def __init__(self, dataset: Any, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            num_replicas = int_from_env(num_replicas, ("WORLD_SIZE",), 1)
            rank = int_from_env(rank, ("RANK",), 0)
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)


def read_plan(path: str | os.PathLike[str]) -> ShardPlan | None:
    """The plan a launched rank 0 recorded at ``PARAMSERVER_PLAN_FILE`` (None: none was),
    by which a launcher saves the servers' final weights."""
    target = Path(path)
    if not target.exists():
        return None
    return ShardPlan.from_description(json.loads(target.read_text()))


def make_plan(named: list[tuple[str, torch.Tensor]], num_shards: int, chunk_bytes: int,
          tables: list[TableSpec] | None = None) -> ShardPlan:
    specs = [ParamSpec(name, tuple(p.shape), dtype_name(p.dtype)) for name, p in named]
    return ShardPlan(specs, num_shards, chunk_bytes, sparse=tables or ())

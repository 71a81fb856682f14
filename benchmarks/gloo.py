"""gloo all_reduce: what a synchronous data-parallel user would pick instead.

Each of N processes all-reduces its gradient (in place, sum), takes the mean
and applies the optimizer step locally, ``p -= lr * g``: the same work per
step as a sync parameter-server round, with no server in the way.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from paramserver.util.jsontypes import JSONObject

from .common import integer, number, text

__all__ = ["GlooSession"]


class GlooSession:
    """One rank of a gloo process group. ``args``: rank, world, port, lr; across hosts,
    host (rank 0's address) and ifname (the NIC gloo's ranks reach each other on).

    Opening blocks until every rank has joined; every rank must be asked to
    measure the same payload at the same time.
    """

    def __init__(self, args: JSONObject) -> None:
        self.world = integer(args, "world")
        self.lr = number(args, "lr")
        ifname = text(args, "ifname", "")
        if ifname:  # else gloo takes the address this host's name resolves to
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
        host = text(args, "host", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{integer(args, 'port')}",
                                rank=integer(args, "rank"), world_size=self.world,
                                timeout=timedelta(seconds=300))
        self.numel = -1
        self.grad = self.weights = torch.zeros(0)

    def measure(self, numel: int, iters: int) -> float:
        if numel != self.numel:
            self.numel = numel
            self.grad = torch.full((numel,), 1e-3)
            self.weights = torch.zeros(numel)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(self.grad)
            self.grad.div_(self.world)  # the mean, as DDP takes it (values stay bounded)
            self.weights.add_(self.grad, alpha=-self.lr)
        return (time.perf_counter() - t0) / iters

    def close(self) -> JSONObject:
        dist.destroy_process_group()
        return {}

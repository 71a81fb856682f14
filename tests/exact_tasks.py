"""Deterministic float64 tasks for exactness tests: rank r's batch k is known in advance,
so a single process can replay the union of every worker's batches."""

from __future__ import annotations

import torch
from torch import nn

from paramserver.workers.tasks import Task

FEATURES, HIDDEN, OUTPUTS = 6, 8, 3


def make_model(seed: int = 0) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUTPUTS)
        ).double()


def batch(rank: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(size, FEATURES, generator=g, dtype=torch.float64)
    y = torch.randn(size, OUTPUTS, generator=g, dtype=torch.float64)
    return x, y


def batch_size(rank: int, unequal: bool) -> int:
    return 4 + 3 * rank if unequal else 5


def make_task(rank: int, world_size: int, steps: int = 12, unequal: bool = False,
              seed: int = 0) -> Task:
    n = batch_size(rank, unequal)
    return Task(
        model=make_model(seed),
        batches=[batch(rank, k, n) for k in range(steps)],
        loss_fn=nn.functional.mse_loss,
    )

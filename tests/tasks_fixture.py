"""Tiny task factories used by tests/test_tasks.py through ``module:function``."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from paramserver.workers.tasks import Task


def make_task(*, rank: int, world_size: int, scale: float = 1.0, flag: bool = False,
              n: int = 8) -> Task:
    """A linear regression with ``n`` examples, split by rank."""
    torch.manual_seed(0)
    x = torch.arange(float(n)).reshape(n, 1)
    y = scale * x
    mine = list(range(rank, n, world_size))
    return Task(
        model=nn.Linear(1, 1),
        batches=[(x[mine], y[mine])],
        loss_fn=F.mse_loss,
        eval_batches=[(x, y)],
        description=f"fixture scale={scale!r} flag={flag!r} n={n!r}",
    )


def make_duck(*, rank: int, world_size: int) -> SimpleNamespace:
    """A duck-typed task (no Task class)."""
    x = torch.eye(3)
    y = torch.tensor([0, 1, 2])
    return SimpleNamespace(
        model=nn.Linear(3, 3), batches=[(x, y)], loss_fn=F.cross_entropy,
        eval_batches=[(x, y)], classification=True,
    )


def no_context() -> SimpleNamespace:
    """A factory that ignores rank and world_size altogether."""
    return SimpleNamespace(model=nn.Linear(1, 1), batches=[], loss_fn=F.mse_loss)


def no_loss(*, rank: int, world_size: int) -> SimpleNamespace:
    return SimpleNamespace(model=nn.Linear(1, 1), batches=[])


def bad_model(*, rank: int, world_size: int) -> SimpleNamespace:
    return SimpleNamespace(model="not a module", batches=[], loss_fn=F.mse_loss)

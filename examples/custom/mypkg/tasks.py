"""A custom task: tell two noisy concentric rings apart with a small MLP.

A task factory is called as ``make_task(rank=r, world_size=n, **task_args)``
and returns a :class:`paramserver.workers.tasks.Task`. Rules that make experiments fair:

* every rank builds the same initial weights (seed the model init);
* every rank gets its own slice of the training data (here: every n-th example);
* ``eval_batches`` is held-out data, the same on every rank;
* ``seed`` and ``batch_size`` are passed by the experiment when the factory accepts them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paramserver import EpochBatches, Task


def _rings(n: int, noise: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    label = torch.randint(0, 2, (n,), generator=generator)
    radius = 0.5 + 0.5 * label.float()  # class 0 on the inner ring, class 1 on the outer
    angle = torch.rand(n, generator=generator) * 2 * math.pi
    x = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return x + noise * torch.randn(n, 2, generator=generator), label


def make_task(*, rank: int, world_size: int, seed: int = 0, batch_size: int = 32,
              samples: int = 2000, hidden: int = 32, noise: float = 0.1) -> Task:
    """Two rings, an MLP 2 -> hidden -> 2 with ReLU; 20% of the points held out."""
    data = torch.Generator().manual_seed(1234)  # the data set is the same for every seed
    x, y = _rings(samples, noise, data)
    n_train = int(0.8 * samples)
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, 2))
    mine = torch.arange(rank, n_train, world_size)  # this rank's share of the training split
    held_out = [(x[n_train:], y[n_train:])]
    return Task(model=model, batches=EpochBatches(x[mine], y[mine], batch_size, seed, rank),
                loss_fn=F.cross_entropy, eval_batches=held_out, classification=True,
                description=f"two rings, rank {rank}/{world_size}")

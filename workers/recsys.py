"""The built-in task ``recsys``: a factorization model on synthetic Zipfian interactions,
its user and item tables :class:`~paramserver.ShardedEmbedding` on the shards.

Ids are Zipf-distributed (a few very active users and popular items, a long
tail), as in real logs. A user and an item each carry ``latent`` hidden signs
computed from a hash of their id (no table: 10M ids cost nothing to generate);
an interaction is positive with probability ``sigmoid(sharpness x <signs_u,
signs_i> / sqrt(latent))``. The model scores ``<user_u, item_i> + b``; the loss
is the log loss, reported on a held-out split of interactions.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paramserver.errors import ConfigError
from paramserver.workers.embedding import ShardedEmbedding
from paramserver.workers.tasks import (
    _DATA_STREAM,
    Task,
    _assemble,
    _check_common,
    _derive_seed,
    register_task,
)

__all__ = ["FactorizationModel", "interactions", "recsys"]

MAX_ROWS = 10_000_000
_MIX = np.uint64(0xD6E8FEB86659FD93)


class FactorizationModel(nn.Module):
    """``<user_u, item_i> + b`` over two sharded tables; inputs are (batch, 2) int64."""

    def __init__(self, users: int, items: int, dim: int, std: float, seed: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.users = ShardedEmbedding(users, dim, dtype=dtype, std=std, seed=seed)
        self.items = ShardedEmbedding(items, dim, dtype=dtype, std=std, seed=seed + 1)
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        u, i = self.users(pairs[:, 0]), self.items(pairs[:, 1])
        return (u * i).sum(1) + self.bias


def _signs(ids: np.ndarray, latent: int, salt: int) -> np.ndarray:
    """(n, latent) hidden +-1 of each id, from a hash: the same in every process."""
    out = np.empty((len(ids), latent))
    x = ids.astype(np.uint64)
    with np.errstate(over="ignore"):
        for j in range(latent):
            h = (x + np.uint64(salt * 7919 + j * 104729)) * _MIX
            out[:, j] = ((h >> np.uint64(40)) & np.uint64(1)).astype(np.float64) * 2 - 1
    return out


def interactions(n: int, users: int, items: int, *, zipf: float, latent: int,
                 sharpness: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` (user, item) pairs with Zipfian ids and their 0/1 labels."""
    rng = np.random.default_rng(seed)
    u = (rng.zipf(zipf, n) - 1) % users
    i = (rng.zipf(zipf, n) - 1) % items
    score = (_signs(u, latent, 1) * _signs(i, latent, 2)).sum(1) / np.sqrt(latent)
    p = 1 / (1 + np.exp(-sharpness * score))
    y = (rng.random(n) < p).astype(np.float32)
    return torch.from_numpy(np.stack([u, i], 1).astype(np.int64)), torch.from_numpy(y)


@register_task("recsys", description="factorization model on Zipfian user/item "
                                     "interactions, tables on the shards (ShardedEmbedding)")
def recsys(
    *,
    rank: int,
    world_size: int,
    seed: int = 0,
    batch_size: int = 256,
    dtype: str = "float32",
    users: int = 100_000,
    items: int = 20_000,
    dim: int = 16,
    samples: int = 20_000,
    eval_samples: int = 2_000,
    zipf: float = 1.2,
    latent: int = 4,
    sharpness: float = 3.0,
    init_std: float = 0.1,
) -> Task:
    """``users`` x ``dim`` and ``items`` x ``dim`` tables (each up to 10M rows) on the
    shards; ``samples`` training interactions split among the ranks and
    ``eval_samples`` held out, the same on every rank. Train it with ``--optimizer
    adagrad`` (or sgd, adam): the servers step the tables' touched rows only."""
    torch_dtype = _check_common(seed, batch_size, dtype)
    for what, value in (("users", users), ("items", items)):
        if not 1 <= value <= MAX_ROWS:
            raise ConfigError(f"recsys: {what} must be in 1..{MAX_ROWS}, got {value}")
    if dim < 1 or samples < 1 or eval_samples < 1 or latent < 1:
        raise ConfigError("recsys: dim, samples, eval_samples and latent must be >= 1")
    if zipf <= 1:
        raise ConfigError(f"recsys: zipf must be > 1, got {zipf}")
    pairs, labels = interactions(samples + eval_samples, users, items, zipf=zipf,
                                 latent=latent, sharpness=sharpness,
                                 seed=_derive_seed(seed, _DATA_STREAM))
    labels = labels.to(torch_dtype)
    model = FactorizationModel(users, items, dim, init_std, seed, torch_dtype)
    return _assemble(
        "recsys", model, (pairs[:samples], labels[:samples]),
        (pairs[samples:], labels[samples:]), F.binary_cross_entropy_with_logits, False,
        rank=rank, world_size=world_size, seed=seed, batch_size=batch_size,
    )

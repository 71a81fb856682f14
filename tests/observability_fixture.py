"""Misbehaving tasks and policies for tests/test_observability_e2e.py (loaded as module:name).

Nothing here is a test-only switch in the production code: the faults live in
a task (a model whose backward pass scales its gradient) and a policy, as a
user's own code could.
"""

from __future__ import annotations

import urllib.request
from typing import Any

import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

from paramserver.policies import Decision, StalenessPolicy, UpdateInfo
from paramserver.workers.tasks import Task, create_task


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class ScaledGradient(nn.Module):
    """Wraps a model; every parameter's gradient comes out multiplied by ``scale``.

    The reported loss is untouched: only the pushed direction (or size) is wrong.
    Every rank wraps its model, so parameter names (and the shard plan) agree.
    """

    def __init__(self, inner: nn.Module, scale: float) -> None:
        super().__init__()
        self.inner = inner
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaleGradient.apply(self.inner(x), self.scale)


def digits_bad_ranks(*, rank: int, world_size: int, seed: int = 0, batch_size: int = 32,
                     zero_rank: int = -1, negate_rank: int = -1, nan_rank: int = -1,
                     ascend: bool = False) -> Task:
    """digits-mlp, where rank ``zero_rank`` pushes all-zero gradients, ``negate_rank``
    the negated gradient and ``nan_rank`` NaN; with ``ascend`` every rank pushes the
    negated gradient (gradient ascent)."""
    task = create_task("digits-mlp", rank, world_size, {"seed": seed, "batch_size": batch_size})
    scale = {zero_rank: 0.0, negate_rank: -1.0, nan_rank: float("nan")}.get(
        rank, -1.0 if ascend else 1.0)
    task.model = ScaledGradient(task.model, scale)
    return task


class KeepOneIn(StalenessPolicy):
    """Rejects every push except one in ``every`` (by the pushing worker's clock)."""

    name = "keep-one-in"

    def __init__(self, every: int = 20) -> None:
        self.every = every

    def decide(self, update: UpdateInfo) -> Decision:
        if update.clock % self.every == 0:
            return Decision(True)
        return Decision(False, 0.0, f"not 1 in {self.every}")


Sample = tuple[str, tuple[tuple[str, str], ...]]


def scrape(url: str) -> dict[Sample, float]:
    """GET a Prometheus endpoint: (sample name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out

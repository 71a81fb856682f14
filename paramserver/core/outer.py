"""Outer optimizers for local SGD that torch.optim lacks: delayed Nesterov.

Liu et al. (2024), "Asynchronous Local-SGD Training for Language Modeling"
(arXiv 2401.09135): with asynchronous pseudo-gradients, applying Nesterov
momentum on every one amplifies the stale ones. Delayed Nesterov applies the
momentum only every ``delay`` outer steps, on the mean of the pseudo-gradients
that arrived since, and takes plain SGD steps on each pseudo-gradient in
between. A shard's outer step is one push (one version), so ``delay`` and
staleness both count pseudo-gradients, not local steps.

Registered as ``delayed-nesterov`` in :data:`paramserver.core.optim.OPTIMIZER_REGISTRY`:
``--optimizer delayed-nesterov --lr 0.7 --optimizer-arg delay=4``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["DelayedNesterov"]

log = logging.getLogger(__name__)


class DelayedNesterov(torch.optim.Optimizer):
    """Momentum applied every ``delay``-th step only; SGD steps in between.

    Per parameter, with the pseudo-gradient ``g`` of step ``t`` (counted from 1),
    the momentum buffer ``m`` and the sum ``a`` of the gradients since the last
    momentum step::

        a += g
        if t % delay == 0:
            m = momentum * m + a / delay
            p -= lr * (g + momentum * m)       # nesterov=True
            p -= lr * (g + momentum * m_old)   # nesterov=False (heavy ball)
            a = 0
        else:
            p -= lr * g

    With ``delay=1`` this is ``torch.optim.SGD(momentum=..., nesterov=...)`` exactly;
    with ``momentum=0`` it is plain SGD. The state (``momentum_buffer``,
    ``pending``, ``step``) is in :meth:`state_dict`, so checkpoints resume it.

    Args:
        lr: the outer learning rate (DiLoCo uses 0.7).
        momentum: the momentum factor, in [0, 1) (DiLoCo and Liu et al. use 0.9).
        delay: N, the number of outer steps (pushes) between momentum steps; Liu et
            al. set it to the number of workers, so that one momentum step follows
            about one pseudo-gradient from each.
        nesterov: Nesterov's look-ahead (the default) or heavy-ball momentum.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 lr: float = 0.7, momentum: float = 0.9, delay: int = 4,
                 nesterov: bool = True) -> None:
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate: {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if isinstance(delay, bool) or not isinstance(delay, int) or delay < 1:
            raise ValueError(f"delay must be an int >= 1, got {delay!r}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "delay": delay,
                                  "nesterov": bool(nesterov)})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu, delay = group["lr"], group["momentum"], group["delay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["momentum_buffer"] = torch.zeros_like(p)
                    state["pending"] = torch.zeros_like(p)
                state["step"] += 1
                pending: torch.Tensor = state["pending"]
                pending.add_(g)
                if state["step"] % delay:
                    p.add_(g, alpha=-lr)
                    continue
                buf: torch.Tensor = state["momentum_buffer"]
                if group["nesterov"]:
                    buf.mul_(mu).add_(pending, alpha=1.0 / delay)
                    p.add_(g + mu * buf, alpha=-lr)
                else:
                    p.add_(g + mu * buf, alpha=-lr)
                    buf.mul_(mu).add_(pending, alpha=1.0 / delay)
                pending.zero_()
        return loss

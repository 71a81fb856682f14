"""A shard's optimizer step: torch.optim and its scheduler, with the step-size rules
of :mod:`paramserver.stepsize` on top. Pure: no I/O, no clock.

The shard core decides *when* a step happens, on which gradient and with which
weight (the consistency rules); a :class:`Stepper` applies it: it scales the
learning rate by the weight and by the large-batch rule's factor for the step's
number of gradients, sets the asynchrony-aware momentum, steps the optimizer
and its scheduler, and restores the learning rate.

Plain SGD (torch.optim.SGD without momentum, weight decay, Nesterov, maximize
or a scheduler) is stepped as one fused in-place ``p -= lr * g`` over the
shard's tensors instead of through ``optimizer.step()``: the same arithmetic
torch's SGD does for it (``param.add_(grad, alpha=-lr)``), without the
per-step bookkeeping that dominates a small shard's step. Such an optimizer
keeps no state, so its state_dict, and a checkpoint of it, are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import optimizer as hooks

from .errors import ConfigError
from .optim import build_optimizer, build_scheduler
from .stepsize import LrRule, MomentumCompensation, momentum_key

if TYPE_CHECKING:
    from .flat import FlatLayout
    from .probe import Probe
    from .records import CoreConfig

__all__ = ["Stepper", "is_plain_sgd"]


def is_plain_sgd(optimizer: torch.optim.Optimizer) -> bool:
    """``p -= lr * g`` and nothing else: no state, no hooks, a plain float learning rate."""
    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
        return False
    g = optimizer.param_groups[0]
    if g.get("momentum") or g.get("weight_decay") or g.get("nesterov") or g.get("maximize"):
        return False
    if g.get("differentiable") or not isinstance(g.get("lr"), float | int):
        return False
    # a hook on this optimizer (or on every optimizer) expects step() to run
    return not (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or hooks._global_optimizer_pre_hooks or hooks._global_optimizer_post_hooks)


class Stepper:
    """The optimizer over a shard's parameters and the rules that shape its steps."""

    def __init__(self, config: CoreConfig, params: Sequence[torch.Tensor],
                 flat: tuple[FlatLayout, list[torch.Tensor]] | None = None) -> None:
        # with ``flat`` (layout, flat buffers) the optimizer steps one tensor per dtype
        self.flat = flat
        if flat is not None:
            params = flat[1]
        # a shard may own no slices (more shards than chunks): it still keeps clocks
        # and versions, but torch refuses an optimizer over nothing, so use a placeholder
        self.optimizer = build_optimizer(config.optimizer, list(params) or [torch.zeros(1)],
                                         config.optimizer_args)
        self.scheduler = build_scheduler(config.scheduler, self.optimizer,
                                         config.scheduler_args)
        # large-batch learning-rate rule: a factor from each step's number of gradients
        self.lr_rule = LrRule(config.lr_scaling, config.warmup_steps)
        self.lr_factor = 1.0  # the factor of the last step
        # asynchrony-aware momentum: explicit momentum set from the observed staleness
        self.momentum: MomentumCompensation | None = None
        if config.momentum_target is not None:
            if momentum_key(self.optimizer.param_groups[0]) is None:
                raise ConfigError(
                    f"momentum_target needs an optimizer with momentum (sgd, rmsprop) or "
                    f"betas (adam, adamw); {config.optimizer!r} has neither")
            self.momentum = MomentumCompensation(config.momentum_target)
        # plain SGD steps as one fused op; the optimizer is looked at again on each step
        # (a hook or a param group may be added later), through a cheap check of its hooks
        self.fused = self.scheduler is None and self.momentum is None

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state, per slice (as checkpoints hold it) also when it
        steps flat buffers."""
        state = self.optimizer.state_dict()
        return state if self.flat is None else self.flat[0].state_to_slices(state,
                                                                            self.flat[1])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.flat is not None:
            state = self.flat[0].state_from_slices(state, self.flat[1])
        self.optimizer.load_state_dict(state)

    @property
    def lr(self) -> float:
        """The optimizer's current learning rate (its first group's)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def reads_only(self, params: Mapping[str, torch.Tensor]) -> bool:
        """Whether the next step only reads its gradients (the fused plain-SGD step):
        they may then be a worker's own tensors, not a copy."""
        return bool(params) and self.fused and is_plain_sgd(self.optimizer)

    def fused_alpha(self, divisor: float) -> float | None:
        """The fused step's ``-lr / divisor`` for a sync round's step, known before the
        round closes when nothing but the learning rate shapes it; else None."""
        if self.lr_rule.active or self.momentum is not None:
            return None
        return -float(self.optimizer.param_groups[0]["lr"]) / divisor

    def step(self, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor],
             weight: float, *, contributors: int, version: int, staleness: int,
             prior_staleness: int, probe: Probe,
             before_step: Callable[[], None] | None, divisor: float = 1.0,
             ahead: Callable[[float], bool] | None = None) -> None:
        """One optimizer step on ``grads / divisor``, the one that makes ``version + 1``
        (the probe measures it, when it measures this step). A sync round passes its
        sums and sample count: the fused plain-SGD step folds the division into its
        learning rate (one pass fewer over the shard); any other step divides first.
        ``ahead(alpha)``: the fused step's result was computed already, at the rate
        ``alpha`` (paramserver/ahead.py); True when it has become the weights."""
        dense = [grads[k] for k in params]
        fused = bool(dense and self.reads_only(params)
                     and all(g.layout is torch.strided for g in dense))
        if divisor != 1.0 and not fused:  # before any .grad (or flat join) sees them
            with torch.no_grad():
                for grad in dense:
                    grad.div_(divisor)
            divisor = 1.0
        if not fused:  # (the fused step reads ``dense``, and the probe ``grads``)
            for key, p in params.items():
                p.grad = grads[key]
            if self.flat is not None:
                layout, flats = self.flat
                for f in flats:
                    f.grad = layout.join(f.dtype, grads)
        groups = self.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        if self.lr_rule.active:
            self.lr_factor = self.lr_rule.factor(contributors, version)
            weight *= self.lr_factor
        if self.momentum is not None:
            self.momentum.observe(staleness, prior_staleness)
            self.momentum.apply(groups)
        if weight != 1.0:
            for g in groups:
                g["lr"] = g["lr"] * weight
        measure = probe.step_begins(self.optimizer, grad_scale=1.0 / divisor,
                                    grads=grads if fused else None)
        applied_lr = float(groups[0]["lr"])
        alpha = -applied_lr / divisor
        if not (fused and ahead is not None and ahead(alpha)):
            if before_step is not None:
                before_step()
            if fused:
                with torch.no_grad():
                    torch._foreach_add_(list(params.values()), dense, alpha=alpha)
            else:
                self.optimizer.step()
        for g, lr in zip(groups, saved, strict=True):
            g["lr"] = lr
        if not fused:
            for p in params.values():
                p.grad = None
            if self.flat is not None:
                for f in self.flat[1]:
                    f.grad = None
        if self.scheduler is not None:
            self.scheduler.step()
        if measure is not None:
            probe.step_ended(measure, version + 1, applied_lr)

"""A shard's optimizer step: torch.optim and its scheduler, with the step-size rules
of :mod:`paramserver.core.stepsize` on top. Pure: no I/O, no clock.

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

With ``check_finite`` (the default) a step never leaves the weights or the
optimizer's state NaN or Inf: finite gradients can still overflow them (twelve
pushes of 3e38 at lr 0.1 made float32 weights Inf, and every checkpoint after
held them). The fused step is proved safe before it runs, from a bound on the
weights' magnitude kept across steps and the gradient's largest element
(``|w + a g| <= max|w| + |a| max|g|``; one reduction over the gradient); a step
that cannot be proved safe, and every other optimizer's step, runs on a copy
kept of the weights and state, is checked after, and is undone if it made
anything non-finite. :meth:`Stepper.step` then returns False: the step did not
happen. A finite step is not enough for an optimizer that remembers its inputs
(momentum, delayed Nesterov's pending sum, Adam's moments): they act again at later
steps, and three pushes near 1e38 once left momentum that overflowed every later step,
each undone and met again, so that nothing applied after. So a step that is not the
fused one is refused, before it runs, when an element of its gradient is past the
*input limit*, the square root of the weights' dtype's range (float32: 1.8e19):
the weights and the whole state are left as they were, and the pushes after apply.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import optimizer as hooks

from paramserver.core.optim import build_optimizer, build_scheduler
from paramserver.core.probe import all_finite, span
from paramserver.core.stepsize import LrRule, MomentumCompensation, momentum_key
from paramserver.errors import ConfigError

if TYPE_CHECKING:
    from paramserver.core.probe import Probe
    from paramserver.core.records import CoreConfig
    from paramserver.util.flat import FlatLayout

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
        # refuse a step that would make the weights or the optimizer's state non-finite
        self.guard = config.check_finite
        self.refused = 0  # steps undone because they made something NaN or Inf
        # (version, bound): every weight's magnitude is at most bound at that version;
        # None: not known (the weights were set other than by a step)
        self.bound: tuple[int, float] | None = None
        self._limits: tuple[Mapping[str, torch.Tensor], float] | None = None

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

    def set_lr(self, lr: float) -> float | None:
        """Every group's learning rate from now on (a script's change, checked at the
        wire); the one it replaces, or None when it was that already."""
        previous = self.lr
        if all(g["lr"] == lr for g in self.optimizer.param_groups):
            return None
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return previous

    def reads_only(self, params: Mapping[str, torch.Tensor]) -> bool:
        """Whether the next step only reads its gradients (the fused plain-SGD step):
        they may then be a worker's own tensors, not a copy."""
        return bool(params) and self.fused and is_plain_sgd(self.optimizer)

    def fused_alpha(self, divisor: float, contributors: int = 1,
                    version: int = 0) -> float | None:
        """The fused step's ``-lr / divisor`` for a sync round's step averaging
        ``contributors`` gradients at ``version``, known before the round closes
        when nothing but the learning rate and its large-batch rule shape it (as
        :meth:`step` computes it, bit for bit); else None."""
        if self.momentum is not None:
            return None
        lr = self.optimizer.param_groups[0]["lr"]
        if self.lr_rule.active:
            weight = 1.0 * self.lr_rule.factor(contributors, version)
            if weight != 1.0:
                lr = lr * weight
        return -float(lr) / divisor

    def step(self, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor],
             weight: float, *, contributors: int, version: int, staleness: int,
             prior_staleness: int, probe: Probe,
             before_step: Callable[[], None] | None, divisor: float = 1.0,
             ahead: Callable[[float], bool] | None = None,
             grad_norm: float | None = None) -> bool:
        """One optimizer step on ``grads / divisor``, the one that makes ``version + 1``
        (the probe measures it, when it measures this step). A sync round passes its
        sums and sample count: the fused plain-SGD step folds the division into its
        learning rate (one pass fewer over the shard); any other step divides first.
        ``ahead(alpha)``: the fused step's result was computed already, at the rate
        ``alpha`` (paramserver/core/ahead.py); True when it has become the weights.
        False: the step would have made the weights or the optimizer's state NaN or
        Inf, and was undone (``guard``); nothing changed but the gradients' scale.
        ``grad_norm``: the L2 norm of ``grads`` if known (the finite check's), which
        bounds their largest element: the guard's proof then needs no pass over them."""
        dense = [grads[k] for k in params]
        fused = bool(dense and self.reads_only(params)
                     and all(g.layout is torch.strided for g in dense))
        if divisor != 1.0 and not fused:  # before any .grad (or flat join) sees them
            with torch.no_grad():
                for grad in dense:
                    grad.div_(divisor)
            divisor = 1.0
        if self.guard and not fused and self._beyond_input_limit(params, dense, grad_norm):
            self.refused += 1  # refused before it ran: the weights and state are untouched
            return False
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
        kept = None  # a copy to undo the step from (guard, when not proved safe)
        if self.guard and not (fused and self._proved_safe(params, dense, alpha, version,
                                                           grad_norm)):
            kept = self._keep(params)
        if not (fused and kept is None and ahead is not None and ahead(alpha)):
            if before_step is not None:
                before_step()
            if fused:
                with torch.no_grad():
                    torch._foreach_add_(list(params.values()), dense, alpha=alpha)
            else:
                self.optimizer.step()
        undone = kept is not None and not self._finite(params)
        if undone:
            assert kept is not None
            self._undo(params, kept)
        for g, lr in zip(groups, saved, strict=True):
            g["lr"] = lr
        if not fused:
            for p in params.values():
                p.grad = None
            if self.flat is not None:
                for f in self.flat[1]:
                    f.grad = None
        if undone:
            self.refused += 1
            return False
        if self.scheduler is not None:
            self.scheduler.step()
        if measure is not None:
            probe.step_ended(measure, version + 1, applied_lr)
        return True

    # ------------------------------------------------------------------ the guard

    def _proved_safe(self, params: Mapping[str, torch.Tensor],
                     dense: Sequence[torch.Tensor], alpha: float, version: int,
                     grad_norm: float | None = None) -> bool:
        """Whether ``w + alpha * g`` stays finite, proved from the magnitudes alone
        (half the dtype's range is left for rounding); the bound then moves past
        the step. ``grad_norm`` (finite) stands in for the gradient's largest element,
        which it bounds; near the limit both are measured before giving up."""
        if not dense or not all(g.is_floating_point() for g in dense):
            return False
        limit = self._limit(params)
        exact = grad_norm is None or not math.isfinite(grad_norm)
        grow = abs(alpha) * (_largest(dense) if exact else grad_norm)  # type: ignore[operator]
        if not math.isfinite(grow):
            return False
        bound = self.bound[1] if self.bound and self.bound[0] == version else math.inf
        if bound + grow >= limit:  # not known, or grown near the limit: measure it
            bound = _largest(list(params.values()))
            if not exact and not bound + grow < limit:
                grow = abs(alpha) * _largest(dense)
        if not bound + grow < limit:  # (a NaN weight fails this too)
            self.bound = None
            return False
        self.bound = (version + 1, bound + grow)
        return True

    def _beyond_input_limit(self, params: Mapping[str, torch.Tensor],
                            dense: Sequence[torch.Tensor], grad_norm: float | None) -> bool:
        """Whether a gradient element is past the input limit (the square root of the
        weights' dtype's range). A stateful optimizer remembers its inputs (momentum,
        delayed Nesterov's pending sum, Adam's moments) and applies them again at later
        steps, so a finite step is not enough: three pushes near 1e38 left momentum that
        overflowed every later momentum step, each undone and met again, and no push of
        anyone applied after. Below the limit the state stays far from overflow for any
        number of steps (momentum 0.9 holds at most ten inputs' worth), and the square
        of an input (Adam's second moment) is finite. ``grad_norm`` (finite, at most the
        limit) proves it without a pass over the gradient."""
        limit = math.sqrt(self._limit(params) * 2)
        if grad_norm is not None and math.isfinite(grad_norm) and grad_norm <= limit:
            return False
        values = [g.coalesce().values() if g.is_sparse else g for g in dense
                  if g.is_floating_point()]
        return not _largest(values) <= limit  # (NaN is past it too)

    def _limit(self, params: Mapping[str, torch.Tensor]) -> float:
        """Half the smallest range of the weights' dtypes (kept: the dtypes never change)."""
        kept = self._limits
        if kept is None or kept[0] is not params:
            kept = self._limits = (params, min((torch.finfo(w.dtype).max
                                                for w in params.values()),
                                               default=math.inf) / 2)  # no weights: no bound
        return kept[1]

    def _keep(self, params: Mapping[str, torch.Tensor]
              ) -> tuple[list[torch.Tensor], dict[Any, dict[str, Any]]]:
        """A copy of the weights and of the optimizer's state, to undo a step from."""
        self.bound = None  # measured again after this step
        state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v
                     for k, v in entries.items()}
                 for p, entries in self.optimizer.state.items()}
        return [t.clone() for t in _spans(params)], state

    def _finite(self, params: Mapping[str, torch.Tensor]) -> bool:
        if not all(all_finite(t) for t in _spans(params) if t.is_floating_point()):
            return False
        return all(all_finite(v) for entries in self.optimizer.state.values()
                   for v in entries.values()
                   if isinstance(v, torch.Tensor) and v.is_floating_point())

    def _undo(self, params: Mapping[str, torch.Tensor],
              kept: tuple[list[torch.Tensor], dict[Any, dict[str, Any]]]) -> None:
        weights, state = kept
        with torch.no_grad():
            for t, old in zip(_spans(params), weights, strict=True):
                t.copy_(old)
        self.optimizer.state.clear()  # (a first step creates state the copy lacks)
        self.optimizer.state.update(state)


def _spans(params: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The weights as one flat view where they lie back to back, else one by one."""
    values = list(params.values())
    whole = span(values)
    return [whole] if whole is not None else values


def _largest(tensors: Sequence[torch.Tensor]) -> float:
    """The largest magnitude of any element (NaN if any is NaN), in float64."""
    whole = span(list(tensors))
    parts = [whole] if whole is not None else tensors
    largest = 0.0
    for t in parts:
        if t.numel():
            # one min-and-max pass: about 10x faster on the CPU than the inf-norm
            # (which makes |t| first), and NaN comes out of both ends
            low, high = torch.aminmax(t)
            value = max(float(high), -float(low))
            if math.isnan(float(low)) or math.isnan(float(high)):
                value = math.nan
            if not value <= largest:  # larger, or NaN (which must not be lost)
                largest = value
    return largest

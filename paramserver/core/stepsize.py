"""Step-size rules a shard applies on top of its optimizer: large-batch learning-rate
scaling with warmup, and asynchrony-aware momentum. Pure: no I/O, no clock.

**Learning-rate scaling** (:class:`LrRule`). A sync round averages the
gradients of its k contributors, so it is one step on a batch k times larger
than one worker's. Goyal et al. 2017 ("Accurate, Large Minibatch SGD: Training
ImageNet in 1 Hour") scale the learning rate linearly with the batch (k times
the one-worker rate) and reach it by a gradual warmup: the rate starts at the
unscaled value and grows by equal amounts per step until it reaches the scaled
one. For adaptive optimizers the square-root rule (sqrt(k) times) is the usual
choice (Hoffer et al. 2017; Krizhevsky 2014). The configured learning rate is
the rate for *one worker's* batch, the rate an async run uses per gradient.
The factor is computed per step from that step's live number of accepted
gradients, so it stays right when workers die, finish or are dropped as
backups. An async or SSP step applies one gradient, so its factor is 1: the
rules change nothing there, by construction, and a spec may set them for every
mode.

**Asynchrony-aware momentum** (:class:`MomentumCompensation`). Mitliagkas,
Zhang, Hadjis and Ré 2016 ("Asynchrony begets momentum, with an application to
deep learning") show that under a simple queueing model asynchronous SGD with
staleness behaves in expectation like momentum SGD with an *implicit* momentum
that grows with the number of workers, ``1 - 1/M`` with M workers, and that the
explicit momentum should then be lowered. We estimate the implicit momentum
from the staleness the shard observes, ``mu_imp = 1 - 1/(mean staleness + 1)``
(with M workers evenly paced the mean staleness is about M - 1, which gives the
paper's ``1 - 1/M``), and pick the explicit momentum so that the two compose to
a target total. Composition rule (ours, an approximation): a momentum ``mu``
amplifies the long-run step by ``1/(1 - mu)``, and the two amplifications
multiply, so ``(1 - mu_total) = (1 - mu_exp)(1 - mu_imp)`` and

    mu_exp = clip(1 - (1 - target) / (1 - mu_imp), 0, target)

With no staleness (1 worker, sync) ``mu_exp = target``; once the implicit
momentum alone exceeds the target, ``mu_exp = 0``. The mean staleness is an
exponential moving average over the accepted updates, decay ``decay``, started
from a prior: the core passes ``live workers - 1`` in async and SSP (the mean
staleness of M evenly paced workers, the paper's model), 0 in sync. Without a
prior the average is bias-corrected (like Adam's moments). Starting from the
prior matters: right after the start barrier every worker has read version 0
and the first pushes have staleness 0, 1, 2, ...; an estimate built from those
alone would keep the full explicit momentum during the very first, largest
updates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from paramserver.errors import ConfigError

__all__ = ["LR_SCALINGS", "LrRule", "MomentumCompensation", "momentum_key"]

LR_SCALINGS: tuple[str, ...] = ("none", "linear", "sqrt")


@dataclass(frozen=True)
class LrRule:
    """Learning-rate factor for a step that averages ``contributors`` gradients."""

    scaling: str = "none"
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        if self.scaling not in LR_SCALINGS:
            raise ConfigError(f"lr scaling must be one of {', '.join(LR_SCALINGS)}; "
                              f"got {self.scaling!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) \
                or self.warmup_steps < 0:
            raise ConfigError(f"warmup steps must be an int >= 0, got {self.warmup_steps!r}")

    @property
    def active(self) -> bool:
        return self.scaling != "none"

    def scale(self, contributors: int) -> float:
        """The full (after warmup) factor for ``contributors`` gradients in one step."""
        k = max(1, contributors)
        if self.scaling == "linear":
            return float(k)
        if self.scaling == "sqrt":
            return math.sqrt(k)
        return 1.0

    def factor(self, contributors: int, step: int) -> float:
        """The factor of optimizer step number ``step`` (0-based: the shard's version
        before it): during warmup, from 1 up to :meth:`scale` in equal increments,
        reaching it at step ``warmup_steps - 1``."""
        full = self.scale(contributors)
        if self.warmup_steps and step < self.warmup_steps:
            return 1.0 + (full - 1.0) * (step + 1) / self.warmup_steps
        return full

    def describe(self) -> str:
        if not self.active:
            return "none"
        return self.scaling + (f", warmup {self.warmup_steps}" if self.warmup_steps else "")


def momentum_key(group: dict[str, Any]) -> str | None:
    """Which entry of an optimizer's param group is its momentum: ``momentum`` (SGD,
    RMSprop) or ``betas`` (Adam family: the first beta); None if it has neither."""
    if "momentum" in group:
        return "momentum"
    if "betas" in group:
        return "betas"
    return None


class MomentumCompensation:
    """Sets the explicit momentum from observed staleness so the total matches ``target``."""

    def __init__(self, target: float, decay: float = 0.95) -> None:
        if not 0.0 <= target < 1.0:
            raise ConfigError(f"momentum target must be in [0, 1), got {target}")
        if not 0.0 < decay < 1.0:
            raise ConfigError(f"staleness decay must be in (0, 1), got {decay}")
        self.target = float(target)
        self.decay = float(decay)
        self._ema = 0.0
        self._weight = 0.0  # 1 - decay**n: the bias correction
        self.updates = 0

    def observe(self, staleness: int, prior: float | None = None) -> None:
        """One accepted update of this staleness. ``prior``: the mean staleness expected
        before anything was observed (with M workers evenly paced, M - 1); the first
        update then starts the average from it instead of from nothing."""
        if self.updates == 0 and prior is not None:
            self._ema, self._weight = max(0.0, float(prior)), 1.0
        self._ema = self.decay * self._ema + (1.0 - self.decay) * max(0, staleness)
        self._weight = self.decay * self._weight + (1.0 - self.decay)
        self.updates += 1

    @property
    def mean_staleness(self) -> float:
        return self._ema / self._weight if self._weight > 0 else 0.0

    @property
    def implicit(self) -> float:
        """Estimated implicit momentum of asynchrony: 1 - 1/(mean staleness + 1)."""
        return 1.0 - 1.0 / (self.mean_staleness + 1.0)

    @property
    def explicit(self) -> float:
        """The momentum to set: (1 - target) = (1 - explicit)(1 - implicit), clipped."""
        value = 1.0 - (1.0 - self.target) / (1.0 - self.implicit)
        return min(self.target, max(0.0, value))

    def apply(self, groups: list[dict[str, Any]]) -> float:
        """Set every param group's momentum to :attr:`explicit`; return it."""
        mu = self.explicit
        for group in groups:
            key = momentum_key(group)
            if key == "momentum":
                group["momentum"] = mu
            elif key == "betas":
                group["betas"] = (mu, *tuple(group["betas"])[1:])
        return mu

    def state_dict(self) -> dict[str, float]:
        return {"ema": self._ema, "weight": self._weight, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ema = float(state.get("ema", 0.0))
        self._weight = float(state.get("weight", 0.0))
        self.updates = int(state.get("updates", 0))

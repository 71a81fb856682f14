"""Staleness policies: the interface and the simple built-ins.

A policy is pure: no I/O, no locks, no sockets. The shard core asks it about
every push before applying it (:meth:`StalenessPolicy.decide`). The returned
weight multiplies that step's learning rate, so it means the same for SGD and
Adam. Policies that rewrite the gradient (DC-ASGD, Gap-Aware) set
``needs_read_weights`` and override :meth:`StalenessPolicy.rewrite_gradient`.
Policies that steer the SSP bound (``ssp-adaptive``) override
:meth:`StalenessPolicy.staleness_bound`, which the core consults in ssp mode.

The registry that finds policies by name is :mod:`paramserver.policies.registry`.
"""

from __future__ import annotations

import abc
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from paramserver.errors import ConfigError

__all__ = [
    "BoundStats",
    "Decision",
    "ExponentialPolicy",
    "InversePolicy",
    "NoPolicy",
    "PolicyFactory",
    "RejectPolicy",
    "StalenessPolicy",
    "UpdateInfo",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpdateInfo:
    """What the core knows about one push when it decides on it."""

    worker: int
    shard: int
    staleness: int  # tau = version - read_version, at decision time
    read_version: int
    version: int
    clock: int  # the pushing worker's clock (pushes it completed before this one)
    min_clock: int  # the smallest clock among live workers
    num_samples: int
    # a sparse push (paramserver/sparse/shard.py): the rows it carries, and how many of them
    # a step changed since the worker read them (staleness is the table shard's
    # version difference); 0 for dense pushes
    rows: int = 0
    stale_rows: int = 0


@dataclass(frozen=True)
class Decision:
    """Apply (``accept``) with this learning-rate ``weight``, or reject for ``reason``."""

    accept: bool
    weight: float = 1.0
    reason: str = ""

    def __post_init__(self) -> None:
        if not math.isfinite(self.weight) or self.weight < 0:
            raise ConfigError(f"Decision.weight must be finite and >= 0, got {self.weight!r}")
        if not self.accept and not self.reason:
            object.__setattr__(self, "reason", "rejected")


ACCEPT = Decision(True)


@dataclass(frozen=True)
class BoundStats:
    """What one shard has measured so far, for policies that set the SSP bound.

    Counters are cumulative since the shard started; a rule that works on
    windows keeps the previous values and takes differences.
    """

    now: float  # the core's time argument of this call, seconds
    configured: int  # the bound the shard was started with (ModeSpec.staleness_bound)
    current: int  # the bound in force before this call
    live_workers: int
    min_clock: int
    max_clock: int
    pushes: int  # pushes decided (duplicates excluded)
    staleness_sum: int  # sum of tau over those pushes
    pulls: int  # worker pulls answered (observers excluded)
    wait_seconds: float  # total time those pulls were held by the gate
    blocked_pulls: int  # worker pulls held by the gate right now


class StalenessPolicy(abc.ABC):
    """Decide whether a (possibly stale) update is applied, and with what weight.

    Subclasses set ``name`` and implement :meth:`decide`. Constructor keyword
    arguments are the policy's parameters (``--policy-arg key=value``); give
    them type annotations so command-line strings are converted.
    """

    name: ClassVar[str] = ""
    #: set to True to receive the weights each worker read in rewrite_gradient
    needs_read_weights: ClassVar[bool] = False

    @abc.abstractmethod
    def decide(self, update: UpdateInfo) -> Decision:
        """Return the decision for this update. Must not raise for valid input."""

    def rewrite_gradient(
        self,
        update: UpdateInfo,
        grad: Mapping[str, torch.Tensor],
        weights: Mapping[str, torch.Tensor],
        read_weights: Mapping[str, torch.Tensor] | None,
        lr: float,
    ) -> Mapping[str, torch.Tensor]:
        """Return the gradient to apply (default: unchanged).

        ``grad``, ``weights`` and ``read_weights`` are keyed by slice key; do
        not modify ``weights`` or ``read_weights``. ``lr`` is the current base
        learning rate of the shard's optimizer.
        """
        return grad

    def staleness_bound(self, stats: BoundStats) -> int | None:
        """In ssp mode, the bound s to enforce from now on; None keeps the configured one.

        Called by the core before it checks the SSP gate (at most once per
        :meth:`~paramserver.core.shard.ShardCore.ready_pulls`), never in other modes.
        Return an int >= 0. Default: None.
        """
        return None

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state saved in checkpoints (default: none)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:  # noqa: B027 - optional hook
        """Restore what :meth:`state_dict` returned."""

    def describe(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{self.name}({params})"


class NoPolicy(StalenessPolicy):
    """Apply every update at full weight, however stale."""

    name = "none"

    def decide(self, update: UpdateInfo) -> Decision:
        return ACCEPT


class RejectPolicy(StalenessPolicy):
    """Reject updates staler than ``max_staleness``; apply the rest at full weight."""

    name = "reject"

    def __init__(self, max_staleness: int = 4) -> None:
        if max_staleness < 0:
            raise ConfigError(f"reject: max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = int(max_staleness)

    def decide(self, update: UpdateInfo) -> Decision:
        if update.staleness > self.max_staleness:
            return Decision(False, 0.0, f"staleness {update.staleness} > {self.max_staleness}")
        return ACCEPT


class InversePolicy(StalenessPolicy):
    """Staleness-aware ASGD: learning-rate weight 1 / max(1, tau)."""

    name = "inverse"

    def decide(self, update: UpdateInfo) -> Decision:
        return Decision(True, 1.0 / max(1, update.staleness))


class ExponentialPolicy(StalenessPolicy):
    """Learning-rate weight ``decay ** tau``."""

    name = "exponential"

    def __init__(self, decay: float = 0.5) -> None:
        if not 0.0 < decay <= 1.0:
            raise ConfigError(f"exponential: decay must be in (0, 1], got {decay}")
        self.decay = float(decay)

    def decide(self, update: UpdateInfo) -> Decision:
        return Decision(True, self.decay ** update.staleness)


PolicyFactory = Callable[[], StalenessPolicy]

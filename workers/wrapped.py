"""The script's own optimizer inside DistributedOptimizer, as Horovod and BytePS wrap it.

``DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))``:

* the wrapped optimizer's class and hyper-parameters go to the shards with the HELLO
  (paramserver/core/hyper.py); they run it when the launch named no optimizer, and
  refuse the worker in one line when it named another;
* the two share ``param_groups``: ``opt.param_groups[0]["lr"] /= 4`` (or a torch lr
  scheduler on either, ``ReduceLROnPlateau`` included) changes the same dicts, and the
  evaluating rank's change goes to the shards with its next push. At construction the
  groups take the shards' learning rate, so a resumed run's script sees the lr that
  training had reached, not the one it was built with.

The wrapped optimizer never steps: the shards hold its state (momentum, moments).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from paramserver.core.hyper import OptimizerSpec, group_lr
from paramserver.errors import ConfigError

__all__ = ["Wrapped"]

log = logging.getLogger(__name__)


class Wrapped:
    """A script's optimizer over a model's parameters: its spec, and its lr changes."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 params: Mapping[str, torch.Tensor]) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"DistributedOptimizer(model, optimizer): optimizer must be a "
                              f"torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.spec = OptimizerSpec.of(optimizer)
        held = [p for g in optimizer.param_groups for p in g["params"]]
        want = {id(p) for p in params.values()}
        if {id(p) for p in held} != want or len(held) != len(want):
            raise ConfigError(
                f"the wrapped {type(optimizer).__name__} holds {len(held)} tensors, the "
                f"model {len(want)} parameters: the servers step every parameter of the "
                f"model, so build it over model.parameters()")
        self.optimizer = optimizer
        self.sent = self.spec.lr  # the learning rate the shards have, as far as we know
        self._warned = False

    def share(self, owner: torch.optim.Optimizer, servers_lr: float | None) -> None:
        """``owner`` (the DistributedOptimizer) takes the wrapped one's param_groups, set
        to the shards' learning rate (a resumed run's may have been changed)."""
        owner.param_groups = self.optimizer.param_groups
        owner.defaults = self.optimizer.defaults
        if servers_lr is not None and servers_lr != self.sent:
            for group in owner.param_groups:
                group["lr"] = servers_lr
            self.sent = servers_lr

    def change(self, evaluates: bool, rank: int) -> float | None:
        """The learning rate the next push sets on the shards: the groups' when this rank
        evaluates and it changed since the shards were told; else None."""
        lr = group_lr(self.optimizer.param_groups)
        if lr == self.sent:
            return None
        if not evaluates:
            if not self._warned:
                self._warned = True
                log.warning("rank %d set lr %g: only the evaluating rank's lr changes reach "
                            "the servers", rank, lr)
            return None
        return lr

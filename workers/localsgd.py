"""Local SGD / DiLoCo on the worker: H inner steps, then one push of the weights' change.

The inner optimizer (e.g. AdamW) and its state stay on the worker; the servers'
optimizer is the outer one. Every ``sync_every``-th step the worker pushes the
pseudo-gradient ``anchor - local`` (the weights last pulled minus the weights now),
with the sample count of the H steps, then pulls: so an outer SGD step with lr 1
lands on the (averaged) local weights, and with momentum/Nesterov it is DiLoCo.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from paramserver.errors import ConfigError

__all__ = ["LocalSteps"]

log = logging.getLogger(__name__)


class LocalSteps:
    """The inner optimizer, the round length H and the weights the round started from."""

    def __init__(self, inner: torch.optim.Optimizer, sync_every: int,
                 params: Mapping[str, torch.Tensor]) -> None:
        if sync_every < 1:
            raise ConfigError(f"sync_every must be >= 1, got {sync_every}")
        ours = {id(p) for p in params.values()}
        theirs = [p for g in inner.param_groups for p in g["params"]]
        if any(id(p) not in ours for p in theirs):
            raise ConfigError("the local optimizer must be built over the model's own "
                              "parameters (model.parameters())")
        self.inner = inner
        self.sync_every = sync_every
        self.params = params
        self.anchor: dict[str, torch.Tensor] | None = None  # the weights last pulled
        self.taken = 0  # inner steps since the last push
        self.samples = 0  # their samples, summed: the push's weight in a sync round
        self.compute = 0.0  # their compute and injected sleep, for the push's record
        self.slept = 0.0

    def mark(self) -> None:
        """The weights now in the model start a new round (after a pull)."""
        with torch.no_grad():
            self.anchor = {n: p.detach().clone() for n, p in self.params.items()}
        self.taken = self.samples = 0
        self.compute = self.slept = 0.0

    def step(self, num_samples: int, compute: float, slept: float) -> bool:
        """One inner step; True when it ends the round (the caller pushes and pulls)."""
        if self.anchor is None:
            self.mark()
        self.inner.step()
        self.taken += 1
        self.samples += num_samples
        self.compute += compute
        self.slept += slept
        return self.taken >= self.sync_every

    def pseudo_gradient(self) -> dict[str, torch.Tensor]:
        """``anchor - local`` per parameter: what an outer SGD step at lr 1 subtracts."""
        assert self.anchor is not None
        with torch.no_grad():
            return {n: self.anchor[n] - p for n, p in self.params.items()}

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state, and where this round stands."""
        return {"inner": self.inner.state_dict(), "sync_every": self.sync_every,
                "taken": self.taken, "samples": self.samples,
                "anchor": None if self.anchor is None
                else {n: t.clone() for n, t in self.anchor.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.taken, self.samples = int(state["taken"]), int(state["samples"])
        anchor = state.get("anchor")
        self.anchor = None if anchor is None else {
            n: t.clone().to(self.params[n].device) for n, t in anchor.items()}

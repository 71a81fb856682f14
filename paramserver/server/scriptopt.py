"""A worker script's own optimizer on a shard (paramserver/core/hyper.py has the rules).

* When the launch named no optimizer (``ServerConfig.script_optimizer``), the optimizer
  the first worker's HELLO brings (``DistributedOptimizer(model, torch.optim.SGD(...))``)
  becomes the shard's before its core is built from the plan; a checkpoint keeps it, and
  a resumed shard runs it again.
* Every later HELLO that brings one must bring the same: else it is refused
  ``optimizer_mismatch``, in one line that shows both.
* A PUSH or SPUSH with ``lr`` (the evaluating rank changed its ``param_groups`` lr) sets
  the shard's learning rate before that push is taken: an ``lr_changed`` event, and the
  optimizer's param_groups (so a checkpoint keeps it and a resume restores it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from paramserver.core.hyper import OptimizerSpec, conflict
from paramserver.core.optim import build_optimizer
from paramserver.errors import ConfigError, ErrorCode, ProtocolError
from paramserver.observe import records as ev

if TYPE_CHECKING:
    from paramserver.core.shard import ShardCore
    from paramserver.observe.events import EventLog
    from paramserver.server.config import ServerConfig
    from paramserver.sparse.shard import SparseShard

__all__ = ["META_KEY", "ScriptOptimizer"]

#: the checkpoint metadata's key for the optimizer a script's HELLO brought
META_KEY = "script_optimizer"
_FLAGS = "--optimizer, --lr, --optimizer-arg"


class ScriptOptimizer:
    """What one shard knows of its workers' wrapped optimizer; changes ``config``'s
    ``optimizer`` and ``optimizer_args`` when it adopts one (before the core exists)."""

    def __init__(self, config: ServerConfig, events: EventLog) -> None:
        self.config = config
        self.events = events
        self.adopted: OptimizerSpec | None = None  # the first worker's (or a checkpoint's)

    def adopt(self, spec: OptimizerSpec | None) -> None:
        """Before the core is built: ``spec`` (a HELLO's) becomes the shard's optimizer
        when the launch named none."""
        if spec is not None and self.config.script_optimizer:
            self.adopted = spec
            self.config.optimizer, self.config.optimizer_args = spec.name, spec.kwargs

    def check(self, spec: OptimizerSpec) -> None:
        """A HELLO's ``spec`` against the optimizer the shard runs (ProtocolError)."""
        if self.adopted is not None:
            line = conflict(self.adopted, spec, "another worker's script wraps it")
        else:
            what = (_FLAGS if not self.config.script_optimizer
                    else "the default: the first worker wrapped none")
            try:
                servers = OptimizerSpec.of(build_optimizer(
                    self.config.optimizer, [torch.zeros(1)], self.config.optimizer_args))
            except ConfigError:
                raise ProtocolError(ErrorCode.OPTIMIZER_MISMATCH, (
                    f"the servers run {self.config.optimizer} ({what}), which a script cannot "
                    f"wrap: wrap no optimizer in DistributedOptimizer, or launch without "
                    f"{_FLAGS}")) from None
            line = conflict(servers, spec, what)
        if line is not None:
            raise ProtocolError(ErrorCode.OPTIMIZER_MISMATCH, line)

    def meta(self) -> dict[str, Any]:
        """What a checkpoint keeps of it (the current lr is in the optimizer's state)."""
        return {META_KEY: None if self.adopted is None else self.adopted.to_wire()}

    def restore(self, meta: Mapping[str, Any]) -> None:
        """Before a resumed core is built: the checkpoint's script optimizer, checked as a
        HELLO's is, is the shard's again (when the launch named none)."""
        saved = meta.get(META_KEY)
        if saved is None or not self.config.script_optimizer:
            return
        if not isinstance(saved, dict):
            raise ConfigError(f"field {META_KEY!r} must be a map")
        self.adopt(OptimizerSpec.checked(saved.get("name"), saved.get("args", {}),
                                         what=f"field {META_KEY!r}"))

    def set_lr(self, core: ShardCore, sparse: SparseShard | None, worker: int,
               lr: float) -> None:
        """A push's learning rate, for every later step of the shard (dense and sparse)."""
        previous = core.stepper.set_lr(lr)
        if sparse is not None:
            sparse.stepper.lr = lr
            for group in sparse.stepper.optimizer.param_groups:
                group["lr"] = lr
        if previous is not None:
            self.events.write(ev.LrChanged(shard=self.config.shard, worker=worker,
                                           version=core.version, lr=lr, previous=previous))

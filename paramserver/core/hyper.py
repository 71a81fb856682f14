"""A script's own optimizer as the shards' optimizer: its class and hyper-parameters as a
typed, bounded record, and the rules for adopting it and changing its learning rate.

``DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))``
wraps the script's optimizer, as Horovod and BytePS do. The shards cannot run the
script's object: they run the same torch class, built from an :class:`OptimizerSpec`
(the class's short name and its hyper-parameters as numbers and booleans) that a
worker's HELLO carries and a checkpoint keeps. Never a pickle: the spec is data, and
every field of one that comes from a peer or a file is checked here, once
(:meth:`OptimizerSpec.checked`), against the class's own signature and the bounds its
constructor enforces.

Pure: no sockets, no clock.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from paramserver.core.optim import OPTIMIZERS, resolve_optimizer
from paramserver.errors import ConfigError

__all__ = ["IMPLEMENTATION", "MAX_ARGS", "SUPPORTED", "OptimizerSpec", "check_lr",
           "conflict", "group_lr"]

#: the classes a wrapped optimizer may be: torch's own, by their short names (a shard
#: never imports a class a peer names)
SUPPORTED: dict[type[torch.optim.Optimizer], str] = {
    getattr(torch.optim, cls): short for short, cls in OPTIMIZERS.items()}
#: constructor arguments that choose how a step runs, not what it computes: the shard
#: picks its own (it runs on its own device)
IMPLEMENTATION = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})
#: the most hyper-parameters a spec may carry (torch's optimizers take at most 8)
MAX_ARGS = 16
_MAX_NAME = 32
_MAX_TUPLE = 4  # betas (2) is the longest


def _supported() -> str:
    return ", ".join(f"torch.optim.{c.__name__}" for c in SUPPORTED)


def _hyper_names(cls: type[torch.optim.Optimizer]) -> list[str]:
    """The constructor's hyper-parameters, in its order."""
    return [name for name, p in inspect.signature(cls).parameters.items()
            if name not in IMPLEMENTATION and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _value(key: str, value: Any, where: str) -> Any:
    """A hyper-parameter as a bool, int, finite float or tuple of those (a 0-d tensor,
    as torch allows for lr, becomes a float)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = float(value)
    if isinstance(value, bool | int) and not (isinstance(value, int)
                                              and not isinstance(value, bool)
                                              and abs(value) >= 1 << 53):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{where}: {key}={value} is not finite")
        return value
    if isinstance(value, list | tuple) and 0 < len(value) <= _MAX_TUPLE:
        return tuple(_value(key, v, where) for v in value)
    raise ConfigError(f"{where}: {key}={str(value)[:40]} is not a number, a bool or a "
                      f"tuple of up to {_MAX_TUPLE} numbers")


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer the shards can run: ``name`` (a short name of :data:`SUPPORTED`) and
    every hyper-parameter of its constructor (``args``, defaults filled in), as the
    constructor took them; made only by :meth:`of` and :meth:`checked`."""

    name: str
    args: tuple[tuple[str, Any], ...]

    @property
    def cls(self) -> type[torch.optim.Optimizer]:
        return resolve_optimizer(self.name)

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.args)

    @property
    def lr(self) -> float:
        return float(self.kwargs["lr"])

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> OptimizerSpec:
        """The spec of a script's optimizer; ConfigError (one line naming what works)
        for a class the shards cannot run or param groups they cannot keep apart."""
        kind = type(optimizer)
        if kind not in SUPPORTED:
            raise ConfigError(
                f"DistributedOptimizer cannot run {kind.__module__}.{kind.__qualname__} on the "
                f"servers; it wraps {_supported()} (or wrap nothing and give the servers' "
                f"optimizer with launch --optimizer, --lr, --optimizer-arg)")
        names = _hyper_names(kind)
        groups = [{k: g[k] for k in names if k in g and g[k] is not None}
                  for g in optimizer.param_groups]
        for i, group in enumerate(groups[1:], 1):
            differ = sorted(k for k in group.keys() | groups[0].keys()
                            if _plain(group.get(k)) != _plain(groups[0].get(k)))
            if differ:
                raise ConfigError(
                    f"{kind.__name__}'s param_groups[{i}] differs from param_groups[0] in "
                    f"{', '.join(differ)}: the servers run one optimizer with one set of "
                    f"hyper-parameters over every parameter; give one param group (or "
                    f"groups that agree)")
        return cls.checked(SUPPORTED[kind], dict(groups[0]), what=kind.__name__)

    @classmethod
    def checked(cls, name: Any, args: Any, what: str = "optimizer") -> OptimizerSpec:
        """A spec from untrusted data (a HELLO's map, a checkpoint): ``name`` one of
        :data:`SUPPORTED`'s short names, ``args`` at most :data:`MAX_ARGS` of its
        constructor's hyper-parameters, numbers finite, ``lr`` > 0, and within the
        bounds the constructor itself enforces (it is built once, on one element).
        Raises ConfigError."""
        short = {s: c for c, s in SUPPORTED.items()}
        if not isinstance(name, str) or len(name) > _MAX_NAME or name not in short:
            raise ConfigError(f"{what}: {str(name)[:_MAX_NAME]!r} is not an optimizer the "
                              f"servers run from a script: {', '.join(short)}")
        if not isinstance(args, Mapping) or len(args) > MAX_ARGS:
            raise ConfigError(f"{what}: its hyper-parameters must be a map of at most "
                              f"{MAX_ARGS}")
        kind = short[name]
        names = _hyper_names(kind)
        typed: dict[str, Any] = {}
        for key, value in args.items():
            if not isinstance(key, str) or key not in names:
                raise ConfigError(f"{what}: {kind.__name__} has no hyper-parameter "
                                  f"{str(key)[:_MAX_NAME]!r}; it takes {', '.join(names)}")
            typed[key] = _value(key, value, what)
        if "lr" in typed:
            typed["lr"] = check_lr(typed["lr"], what)
        try:  # the constructor's own bounds (momentum >= 0, betas in [0, 1), ...)
            group = kind([torch.zeros(1)], **typed).param_groups[0]
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"{what}: {kind.__name__}({_show(typed)}): {exc}") from None
        full = {k: _value(k, group[k], what) for k in names
                if k in group and group[k] is not None}
        return cls(name, tuple(full.items()))

    def to_wire(self) -> dict[str, Any]:
        """The HELLO's ``optimizer`` map (tuples as lists, as msgpack and JSON have them)."""
        return {"name": self.name,
                "args": {k: list(v) if isinstance(v, tuple) else v for k, v in self.args}}

    def describe(self, against: OptimizerSpec | None = None) -> str:
        """``SGD(lr=0.01, momentum=0.9)``: the hyper-parameters away from the class's
        defaults (with ``against``: also those that differ from it)."""
        base = OptimizerSpec.checked(self.name, {}).kwargs
        other = against.kwargs if against is not None and against.name == self.name else {}
        shown = {k: v for k, v in self.args
                 if k == "lr" or _plain(v) != _plain(base.get(k))
                 or (k in other and _plain(v) != _plain(other[k]))}
        return f"{self.cls.__name__}({_show(shown)})"


def _plain(value: Any) -> Any:
    """Equal values compare equal: 0 and 0.0, (0.9, 0.999) and [0.9, 0.999]."""
    if isinstance(value, list | tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value


def _show(args: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in args.items())


def conflict(servers: OptimizerSpec, script: OptimizerSpec, servers_what: str) -> str | None:
    """None when ``script`` is the optimizer the servers run, else the one line that
    says how they differ (``servers_what``: where the servers' optimizer came from)."""
    if servers.name == script.name and all(
            _plain(v) == _plain(servers.kwargs.get(k)) for k, v in script.args):
        return None
    return (f"the script's optimizer {script.describe(servers)} is not the servers' "
            f"{servers.describe(script)} ({servers_what}): leave those out to run the "
            f"script's, or make the two agree")


def check_lr(value: Any, what: str = "lr", zero: bool = False) -> float:
    """A learning rate a shard takes: a finite number > 0 (``zero``: >= 0, as what a
    shard runs may be: ``--lr 0``, or a schedule that ends at 0)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise ConfigError(f"{what}: the learning rate must be a finite number "
                          f"{'>=' if zero else '>'} 0, got {str(value)[:40]}")
    return float(value)


def group_lr(groups: list[dict[str, Any]]) -> float:
    """The one learning rate of ``groups`` (every group's; ConfigError if they differ or
    it is out of bounds): what a change made by the script sends the shards."""
    rates = {float(g["lr"]) for g in groups if "lr" in g}
    if len(rates) != 1:
        raise ConfigError(f"param_groups hold the learning rates {sorted(rates)}: the servers "
                          f"keep one; set the same lr in every group")
    return check_lr(rates.pop(), "param_groups' lr")

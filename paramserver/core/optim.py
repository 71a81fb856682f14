"""Server-side optimizers and learning-rate schedulers, built from torch by name.

We never hand-write optimizer math torch has: torch.optim is the reference users
trust, and its state_dict is what checkpoints save (the one rule torch lacks,
local SGD's delayed Nesterov, is a torch.optim.Optimizer in :mod:`.outer`). This
module only turns names and ``key=value`` strings (CLI, configs) into torch
objects, with errors that say which names and parameters exist.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from paramserver.core.outer import DelayedNesterov
from paramserver.errors import ConfigError, RegistryError
from paramserver.util.coerce import MISSING, coerce, parse_kwargs
from paramserver.util.plugins import Registry

__all__ = [
    "OPTIMIZERS",
    "OPTIMIZER_REGISTRY",
    "REQUIRED",
    "SCHEDULERS",
    "SCHEDULER_REGISTRY",
    "build_optimizer",
    "build_scheduler",
    "optimizer_parameters",
    "parse_kwargs",
    "resolve_optimizer",
    "resolve_scheduler",
    "scheduler_parameters",
]

logger = logging.getLogger(__name__)

# Short name -> torch.optim class name.
OPTIMIZERS: dict[str, str] = {
    "sgd": "SGD",
    "adam": "Adam",
    "adamw": "AdamW",
    "adagrad": "Adagrad",
    "rmsprop": "RMSprop",
    "adadelta": "Adadelta",
    "adamax": "Adamax",
    "nadam": "NAdam",
    "radam": "RAdam",
}

# Short name -> torch.optim.lr_scheduler class name. Lookups ignore case, "_" and "-",
# so "multi_step" and "one-cycle" work too.
SCHEDULERS: dict[str, str] = {
    "step": "StepLR",
    "multistep": "MultiStepLR",
    "exponential": "ExponentialLR",
    "cosine": "CosineAnnealingLR",
    "cosinewarmrestarts": "CosineAnnealingWarmRestarts",
    "linear": "LinearLR",
    "constant": "ConstantLR",
    "polynomial": "PolynomialLR",
    "onecycle": "OneCycleLR",
    "cyclic": "CyclicLR",
}

# The shard calls step() with no arguments, so these cannot work there.
_UNUSABLE: dict[str, str] = {
    "LBFGS": "LBFGS needs a closure that re-evaluates the loss; a shard has no loss",
    "ReduceLROnPlateau": "ReduceLROnPlateau needs a metric at every step; a shard has none",
}


class _Required:
    """Marks a constructor parameter without a default in :func:`optimizer_parameters`."""

    def __repr__(self) -> str:
        return "<required>"


REQUIRED: Any = _Required()


def _subclasses_in(module: Any, base: type) -> dict[str, type]:
    return {
        name: obj
        for name, obj in vars(module).items()
        if isinstance(obj, type)
        and issubclass(obj, base)
        and obj is not base
        and not name.startswith("_")
    }


def _check_usable(cls: type) -> None:
    if cls.__name__ in _UNUSABLE:
        raise ConfigError(
            f"{cls.__name__} cannot run on a parameter server: {_UNUSABLE[cls.__name__]}"
        )


def _norm(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def _optimizer_class(obj: Any, name: str) -> type[torch.optim.Optimizer]:
    if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
        raise RegistryError(f"{name!r} is not a torch.optim.Optimizer subclass")
    _check_usable(obj)
    return obj


def _scheduler_class(obj: Any, name: str) -> type[LRScheduler]:
    if not (isinstance(obj, type) and issubclass(obj, LRScheduler)):
        raise RegistryError(f"{name!r} is not a torch.optim.lr_scheduler.LRScheduler subclass")
    _check_usable(obj)
    return obj


def _torch_optimizer(name: str) -> type[torch.optim.Optimizer] | None:
    """A torch.optim class by its class name (any case)."""
    classes = _subclasses_in(torch.optim, torch.optim.Optimizer)
    cls = classes.get(name) or {k.lower(): v for k, v in classes.items()}.get(name.lower())
    return None if cls is None else _optimizer_class(cls, name)


def _torch_scheduler(name: str) -> type[LRScheduler] | None:
    """A torch.optim.lr_scheduler class by its class name (any case, "_" and "-" ignored)."""
    classes = _subclasses_in(torch.optim.lr_scheduler, LRScheduler)
    cls = {_norm(k): v for k, v in classes.items()}.get(_norm(name))
    return None if cls is None else _scheduler_class(cls, name)


#: optimizers by short name (any case); torch.optim class names and module:Class resolve too
OPTIMIZER_REGISTRY: Registry[type[torch.optim.Optimizer]] = Registry(
    "optimizer", group="paramserver.optimizers", check=_optimizer_class,
    normalize=lambda n: n.strip().lower(), fallback=_torch_optimizer,
    hint=lambda: ("or a torch.optim class name: "
                  f"{', '.join(sorted(_subclasses_in(torch.optim, torch.optim.Optimizer)))}; "
                  "or module:Class"))
#: lr schedulers by short name (case, "_" and "-" ignored); class names and module:Class too
SCHEDULER_REGISTRY: Registry[type[LRScheduler]] = Registry(
    "lr scheduler", group="paramserver.schedulers", check=_scheduler_class,
    normalize=_norm, fallback=_torch_scheduler,
    hint=lambda: ("or a torch.optim.lr_scheduler class name: "
                  f"{', '.join(sorted(_subclasses_in(torch.optim.lr_scheduler, LRScheduler)))}"
                  "; or module:Class"))
for _short, _cls_name in OPTIMIZERS.items():
    OPTIMIZER_REGISTRY.register(_short, getattr(torch.optim, _cls_name))
for _short, _cls_name in SCHEDULERS.items():
    SCHEDULER_REGISTRY.register(_short, getattr(torch.optim.lr_scheduler, _cls_name))
# local SGD's outer rule for stale pseudo-gradients (Liu et al. 2024); torch has none
OPTIMIZER_REGISTRY.register("delayed-nesterov", DelayedNesterov)


def resolve_optimizer(name: str) -> type[torch.optim.Optimizer]:
    """Short name (any case), torch.optim class name (``"SGD"``) or ``module:Class``."""
    return OPTIMIZER_REGISTRY.resolve(name.strip())


def resolve_scheduler(name: str) -> type[LRScheduler]:
    """Short name (``"step"``, ``"cosine"``, ...), class name (``"StepLR"``) or ``module:Class``."""
    return SCHEDULER_REGISTRY.resolve(name.strip())


def _parameters(cls: type, skip: int) -> dict[str, inspect.Parameter]:
    """Constructor parameters after the first ``skip`` positional ones."""
    params = list(inspect.signature(cls).parameters.values())[skip:]
    return {p.name: p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _takes_var_keyword(cls: type) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls).parameters.values())


def _defaults(params: Mapping[str, inspect.Parameter]) -> dict[str, Any]:
    return {k: REQUIRED if p.default is p.empty else p.default for k, p in params.items()}


def optimizer_parameters(name: str) -> dict[str, Any]:
    """Keyword parameters of an optimizer and their defaults (:data:`REQUIRED` if none)."""
    return _defaults(_parameters(resolve_optimizer(name), skip=1))


def scheduler_parameters(name: str) -> dict[str, Any]:
    """Keyword parameters of an lr scheduler and their defaults (:data:`REQUIRED` if none)."""
    return _defaults(_parameters(resolve_scheduler(name), skip=1))


def _prepare(what: str, cls: type, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check keys against the signature and type string values like :func:`parse_kwargs`."""
    params = _parameters(cls, skip=1)
    accepted = ", ".join(params) or "none"
    out: dict[str, Any] = {}
    for key, value in (kwargs or {}).items():
        if key not in params and not _takes_var_keyword(cls):
            raise ConfigError(
                f"{what} {cls.__name__} has no parameter {key!r}; accepted: {accepted}"
            )
        # Strings come from flags, env and JSON configs: typed by the parameter's annotation
        # (else its default's type, else guessed like parse_kwargs)
        param = params.get(key)
        out[key] = coerce(value, param.annotation if param else MISSING,
                          param.default if param else MISSING, what=f"{what} argument {key}")
    missing = [k for k, p in params.items() if p.default is p.empty and k not in out]
    if missing:
        raise ConfigError(f"{what} {cls.__name__} needs {', '.join(missing)}; accepted: {accepted}")
    return out


def build_optimizer(
    name: str, params: Iterable[torch.Tensor], kwargs: Mapping[str, Any] | None = None
) -> torch.optim.Optimizer:
    """Instantiate an optimizer over ``params``; bad kwargs raise :class:`ConfigError`."""
    cls = resolve_optimizer(name)
    options = _prepare("optimizer", cls, kwargs)
    params = list(params)
    accepted = ", ".join(_parameters(cls, skip=1))
    if ("foreach" in _parameters(cls, skip=1) and "foreach" not in options
            and cls.__module__.startswith("torch.optim")
            and len(params) >= 4 and all(p.device.type == "cpu" for p in params)):
        # torch picks the multi-tensor kernels on GPUs only; on a CPU shard of many small
        # slices they are the same arithmetic at a fraction of the per-slice Python cost
        # (8 slices of 128: SGD 66 -> 59 us a step, Adam 474 -> 224 us); for one to
        # three slices their grouping costs more than it saves
        options["foreach"] = True
    try:
        optimizer = cls(params, **options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"cannot build optimizer {cls.__name__} with {options}: {exc}; accepted: {accepted}"
        ) from exc
    logger.debug("built optimizer %s with %s", cls.__name__, options)
    return optimizer


def build_scheduler(
    name: str | None, optimizer: torch.optim.Optimizer, kwargs: Mapping[str, Any] | None = None
) -> LRScheduler | None:
    """Instantiate an lr scheduler on ``optimizer``; ``None``, "" or "none" give ``None``."""
    if name is None or name.strip().lower() in ("", "none"):
        if kwargs:
            raise ConfigError(f"scheduler arguments {dict(kwargs)} given without a scheduler")
        return None
    cls = resolve_scheduler(name)
    options = _prepare("lr scheduler", cls, kwargs)
    accepted = ", ".join(_parameters(cls, skip=1))
    try:
        scheduler = cls(optimizer, **options)
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"cannot build lr scheduler {cls.__name__} with {options}: {exc}; accepted: {accepted}"
        ) from exc
    logger.debug("built lr scheduler %s with %s", cls.__name__, options)
    return scheduler

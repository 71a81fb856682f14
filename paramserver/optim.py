"""Server-side optimizers and learning-rate schedulers, built from torch by name.

We never hand-write optimizer math: torch.optim is the reference users trust,
and its state_dict is what checkpoints save. This module only turns names and
``key=value`` strings (CLI, configs) into torch objects, with errors that say
which names and parameters exist.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from .errors import ConfigError, RegistryError
from .plugins import import_object

__all__ = [
    "OPTIMIZERS",
    "REQUIRED",
    "SCHEDULERS",
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


def resolve_optimizer(name: str) -> type[torch.optim.Optimizer]:
    """Short name (any case), torch.optim class name (``"SGD"``) or ``module:Class``."""
    name = name.strip()
    cls: type[torch.optim.Optimizer]
    if ":" in name:
        cls = import_object(name)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise RegistryError(f"{name!r} is not a torch.optim.Optimizer subclass")
    else:
        classes = _subclasses_in(torch.optim, torch.optim.Optimizer)
        by_lower = {k.lower(): v for k, v in classes.items()}
        if name.lower() in OPTIMIZERS:
            cls = classes[OPTIMIZERS[name.lower()]]
        elif name in classes:
            cls = classes[name]
        elif name.lower() in by_lower:
            cls = by_lower[name.lower()]
        else:
            raise RegistryError(
                f"unknown optimizer {name!r}; known: {', '.join(sorted(OPTIMIZERS))} "
                f"(or a torch.optim class name: {', '.join(sorted(classes))}; "
                f"or module:Class)"
            )
    _check_usable(cls)
    return cls


def _norm(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def resolve_scheduler(name: str) -> type[LRScheduler]:
    """Short name (``"step"``, ``"cosine"``, ...), class name (``"StepLR"``) or ``module:Class``."""
    name = name.strip()
    cls: type[LRScheduler]
    if ":" in name:
        cls = import_object(name)
        if not (isinstance(cls, type) and issubclass(cls, LRScheduler)):
            raise RegistryError(f"{name!r} is not a torch.optim.lr_scheduler.LRScheduler subclass")
    else:
        classes = _subclasses_in(torch.optim.lr_scheduler, LRScheduler)
        by_norm = {_norm(k): v for k, v in classes.items()}
        if _norm(name) in SCHEDULERS:
            cls = classes[SCHEDULERS[_norm(name)]]
        elif _norm(name) in by_norm:
            cls = by_norm[_norm(name)]
        else:
            raise RegistryError(
                f"unknown lr scheduler {name!r}; known: {', '.join(SCHEDULERS)} "
                f"(or a torch.optim.lr_scheduler class name: {', '.join(sorted(classes))}; "
                f"or module:Class)"
            )
    _check_usable(cls)
    return cls


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
        # Strings come from env/JSON configs; no torch optimizer wants a number as str.
        out[key] = _parse_value(value) if isinstance(value, str) else value
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


_INT = re.compile(r"[+-]?\d+")


def _number(text: str) -> int | float | None:
    text = text.strip()
    if _INT.fullmatch(text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return None


def _parse_value(text: str) -> Any:
    s = text.strip()
    low = s.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    if "," in s:
        parts = [p for p in s.split(",")]
        if parts and parts[-1].strip() == "":  # "10," is a one-element tuple
            parts = parts[:-1]
        numbers = [_number(p) for p in parts]
        if parts and all(n is not None for n in numbers):
            return tuple(numbers)
        return s
    number = _number(s)
    return s if number is None else number


def parse_kwargs(items: Sequence[str]) -> dict[str, Any]:
    """``["lr=0.1", "nesterov=true", "betas=0.9,0.999"]`` -> typed keyword arguments.

    Values become int, float, bool (true/false), None (none/null), a tuple of
    numbers (comma list; ``"10,"`` is a one-element tuple), else stay str.
    """
    if isinstance(items, str):
        raise ConfigError(f"expected a list of key=value strings, got the string {items!r}")
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(f"argument {item!r} must look like key=value (e.g. lr=0.1)")
        if key in out:
            raise ConfigError(f"argument {key!r} is given twice")
        out[key] = _parse_value(value)
    return out

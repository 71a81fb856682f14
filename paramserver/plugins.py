"""Finding user code by ``module:attribute`` (policies, optimizers, tasks, ...)."""

from __future__ import annotations

import importlib
from typing import Any

from .errors import RegistryError

__all__ = ["import_object"]


def import_object(spec: str) -> Any:
    """Import ``module:attr`` (``attr`` may be dotted); RegistryError says what failed."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RegistryError(f"{spec!r} must look like module:name")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise RegistryError(f"cannot import module {module_name!r} from {spec!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise RegistryError(f"module {module_name!r} has no attribute {attr!r}") from exc
    return obj

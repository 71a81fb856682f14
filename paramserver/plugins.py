"""Finding user code by ``module:attribute`` (policies, optimizers, tasks, ...)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from .errors import RegistryError

__all__ = ["import_object", "load_entry_points"]

log = logging.getLogger(__name__)
_loaded: set[str] = set()


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


def load_entry_points(group: str, register: Callable[[str, Any], object], what: str) -> None:
    """Load each installed entry point of ``group`` once per process, handing
    ``(name, object)`` to ``register``; a broken plug-in is logged, not fatal,
    so that it cannot hide the others."""
    if group in _loaded:
        return
    _loaded.add(group)
    for ep in entry_points(group=group):
        try:
            obj = ep.load()
        except Exception as exc:
            log.warning("%s entry point %r (%s) failed to load: %s", what, ep.name, ep.value, exc)
            continue
        register(ep.name, obj)

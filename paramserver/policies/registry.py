"""The staleness policies by name: the built-ins, installed entry points (group
``paramserver.staleness_policies``), :func:`register_policy` and ``module:Class``.

The built-ins are registered here, not by their defining modules, so that the
interface (:mod:`.base`) and the policies (:mod:`.base`, :mod:`.research`) import
nothing of the registry: the package has no import circle.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

from paramserver.errors import ConfigError, ParamServerError, RegistryError
from paramserver.policies.base import (
    ExponentialPolicy,
    InversePolicy,
    NoPolicy,
    RejectPolicy,
    StalenessPolicy,
)
from paramserver.policies.research import (
    AdaptiveBoundPolicy,
    DCASGDAdaptivePolicy,
    DCASGDPolicy,
    GapAwarePolicy,
)
from paramserver.util.coerce import MISSING, coerce, parse_policy_args
from paramserver.util.plugins import Registry, register_subclass, subclass_check

__all__ = [
    "ENTRY_POINT_GROUP",
    "POLICIES",
    "available_policies",
    "create_policy",
    "parse_policy_args",
    "policy_parameters",
    "register_policy",
    "resolve_policy",
]

ENTRY_POINT_GROUP = "paramserver.staleness_policies"

log = logging.getLogger(__name__)

_REGISTRY: dict[str, type[StalenessPolicy]] = {}


#: the staleness policies by name (built-ins, installed entry points, register_policy)
# (the base is abstract: mypy wants concrete classes for type[...], the check does not)
POLICIES: Registry[type[StalenessPolicy]] = Registry(
    "staleness policy", group=ENTRY_POINT_GROUP,
    check=subclass_check(StalenessPolicy),  # type: ignore[type-abstract]
    hint="or give module:Class", store=lambda: _REGISTRY)


def register_policy(cls: type[StalenessPolicy]) -> type[StalenessPolicy]:
    """Register a policy class under ``cls.name``; refuses duplicates. Usable as a decorator."""
    return register_subclass(POLICIES, StalenessPolicy, cls)  # type: ignore[type-abstract]


for _builtin in (NoPolicy, RejectPolicy, InversePolicy, ExponentialPolicy, DCASGDPolicy,
                 DCASGDAdaptivePolicy, GapAwarePolicy, AdaptiveBoundPolicy):
    register_policy(_builtin)


def available_policies() -> dict[str, type[StalenessPolicy]]:
    """Built-in and installed policies by name."""
    return POLICIES.available()


def resolve_policy(name: str) -> type[StalenessPolicy]:
    """Find a policy class by registered name or ``module:Class``."""
    return POLICIES.resolve(name)


def policy_parameters(cls: type[StalenessPolicy]) -> dict[str, inspect.Parameter]:
    """The constructor parameters of a policy class (its ``--policy-arg`` keys)."""
    sig = inspect.signature(cls.__init__)
    return {k: p for k, p in sig.parameters.items() if (k != "self" and p.kind is p.KEYWORD_ONLY)
            or (k != "self" and p.kind is p.POSITIONAL_OR_KEYWORD)}


def create_policy(name: str, args: Mapping[str, Any] | None = None) -> StalenessPolicy:
    """Instantiate a policy by name (or ``module:Class``) with keyword arguments.

    String values are converted using the constructor's annotations. Unknown
    keys raise :class:`ConfigError` listing the accepted ones.
    """
    cls = resolve_policy(name)
    params = policy_parameters(cls)
    kwargs: dict[str, Any] = {}
    for key, value in (args or {}).items():
        if key not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            accepted = ", ".join(params) or "none"
            raise ConfigError(f"policy {name!r} has no parameter {key!r}; accepted: {accepted}")
        annotation = params[key].annotation if key in params else inspect.Parameter.empty
        kwargs[key] = coerce(value, annotation, params[key].default if key in params else MISSING,
                             what=f"policy argument {key}")
    try:
        policy = cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"cannot create policy {name!r} with {kwargs}: {exc}") from exc
    except ParamServerError:
        raise
    except Exception as exc:  # a user's __init__ may raise anything: one line, not a traceback
        raise ConfigError(f"policy {name} failed to construct: "
                          f"{str(exc) or type(exc).__name__}") from exc
    if not isinstance(policy, StalenessPolicy):
        raise RegistryError(f"{name!r} did not produce a StalenessPolicy")
    return policy

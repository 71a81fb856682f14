"""Staleness policies: the interface (:mod:`.base`), the built-ins (:mod:`.base`,
:mod:`.research`, :mod:`.bounds`) and the registry that finds them by name
(:mod:`.registry`). Pure like the core, which asks a policy about every push.
"""

from paramserver.policies.base import (
    ACCEPT,
    BoundStats,
    Decision,
    ExponentialPolicy,
    InversePolicy,
    NoPolicy,
    PolicyFactory,
    RejectPolicy,
    StalenessPolicy,
    UpdateInfo,
)
from paramserver.policies.registry import (
    ENTRY_POINT_GROUP,
    POLICIES,
    available_policies,
    create_policy,
    parse_policy_args,
    policy_parameters,
    register_policy,
    resolve_policy,
)

__all__ = [
    "ACCEPT",
    "ENTRY_POINT_GROUP",
    "POLICIES",
    "BoundStats",
    "Decision",
    "ExponentialPolicy",
    "InversePolicy",
    "NoPolicy",
    "PolicyFactory",
    "RejectPolicy",
    "StalenessPolicy",
    "UpdateInfo",
    "available_policies",
    "create_policy",
    "parse_policy_args",
    "policy_parameters",
    "register_policy",
    "resolve_policy",
]

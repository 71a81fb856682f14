"""A custom staleness policy: full weight up to a tolerance, then a hinge decay.

A policy subclasses :class:`paramserver.policies.StalenessPolicy`, names itself
with ``name`` and decides on every push in :meth:`decide`. It must be pure: no
I/O, no clocks, no randomness it does not own. Constructor arguments are its
``--policy NAME:key=value`` arguments; annotate them so strings are converted.
"""

from __future__ import annotations

from paramserver import ConfigError, Decision, StalenessPolicy, UpdateInfo


class MyPolicy(StalenessPolicy):
    """Weight 1 up to ``tolerance`` updates of staleness, then 1 / (1 + tau - tolerance);
    reject updates staler than ``max_staleness``."""

    name = "hinge"

    def __init__(self, tolerance: int = 2, max_staleness: int = 16) -> None:
        if not 0 <= tolerance <= max_staleness:
            raise ConfigError(f"hinge: need 0 <= tolerance <= max_staleness, got "
                              f"{tolerance} and {max_staleness}")
        self.tolerance = tolerance
        self.max_staleness = max_staleness

    def decide(self, update: UpdateInfo) -> Decision:
        tau = update.staleness
        if tau > self.max_staleness:
            return Decision(False, 0.0, f"staleness {tau} > {self.max_staleness}")
        return Decision(True, 1.0 / (1 + max(0, tau - self.tolerance)))

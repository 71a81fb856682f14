"""Staleness policies that fail: in their constructor, or in decide() (tests only)."""

from __future__ import annotations

from paramserver.policies import Decision, StalenessPolicy, UpdateInfo


class BoomInit(StalenessPolicy):
    """Its constructor raises."""

    name = "boom-init"

    def __init__(self) -> None:
        raise RuntimeError("the policy's own constructor blew up")

    def decide(self, update: UpdateInfo) -> Decision:  # pragma: no cover - never built
        return Decision(True)


class Boom(StalenessPolicy):
    """Builds fine; every decision raises."""

    name = "boom"

    def decide(self, update: UpdateInfo) -> Decision:
        raise ZeroDivisionError("decide() of tests.broken_policies:Boom divided by zero")

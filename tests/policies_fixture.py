"""Custom staleness policies loaded by tests as module:Class and as entry points."""

from __future__ import annotations

from paramserver.policies import Decision, StalenessPolicy, UpdateInfo


class OnlyWorker(StalenessPolicy):
    """Applies updates from one worker only."""

    name = "only-worker"

    def __init__(self, worker: int = 0) -> None:
        self.worker = worker

    def decide(self, update: UpdateInfo) -> Decision:
        if update.worker == self.worker:
            return Decision(True)
        return Decision(False, 0.0, f"not worker {self.worker}")


class Halve(StalenessPolicy):
    name = "halve"

    def decide(self, update: UpdateInfo) -> Decision:
        return Decision(True, 0.5)

"""What one worker did (:class:`WorkerResult`, its ``results/worker<r>.json``) and its
push counts: the records of :mod:`paramserver.workers.optimizer`, apart from the
optimizer so that readers of results need not load it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from paramserver.observe import records as ev
from paramserver.util.jsontypes import JSON, JSONObject

__all__ = ["PushCounts", "WorkerResult", "drop_none"]


def drop_none(data: JSONObject) -> JSONObject:
    """Optional fields are left out of the file, not written as null (as before records)."""
    return {k: v for k, v in data.items() if v is not None}


@dataclass(frozen=True)
class WorkerResult:
    """What one worker did: its counts, loss, timings and, on the evaluator, held-out figures.

    The built-in loop (``run_worker``, the simulator) fills every field; a user's
    own loop (``DistributedOptimizer.close``) has no train loss or budget, and its
    ``eval`` is the last one it logged (``opt.log(eval_loss=...)``), if any."""

    worker: int
    steps: int  # pushes of this incarnation (a restarted worker resumes: clock >= steps)
    clock: int
    pushes: int
    accepted: int
    rejected: int
    seconds: float
    wait_seconds: float
    final_versions: tuple[int, ...]
    final_train_loss: float | None = None  # mean of the last 10 steps' loss
    train_seconds: float | None = None  # from the first step (the budget's clock)
    budget_seconds: float | None = None
    budget_spent: bool | None = None
    eval: dict[str, float] | None = None  # its final (or last logged) held-out figures

    def to_json(self) -> JSONObject:
        return drop_none({
            "worker": self.worker, "steps": self.steps, "clock": self.clock,
            "pushes": self.pushes, "accepted": self.accepted, "rejected": self.rejected,
            "final_train_loss": self.final_train_loss, "seconds": self.seconds,
            "train_seconds": self.train_seconds, "budget_seconds": self.budget_seconds,
            "budget_spent": self.budget_spent, "wait_seconds": self.wait_seconds,
            "final_versions": [v for v in self.final_versions],
            "eval": None if self.eval is None else {k: v for k, v in self.eval.items()},
        })

    def to_event(self) -> ev.WorkerEnd:
        """The ``worker_end`` record: the fields of :meth:`to_json`."""
        def given(value: Any) -> Any:
            return ev.UNSET if value is None else value

        return ev.WorkerEnd(
            worker=self.worker, steps=self.steps, clock=self.clock, pushes=self.pushes,
            accepted=self.accepted, rejected=self.rejected,
            final_train_loss=given(self.final_train_loss), seconds=self.seconds,
            train_seconds=given(self.train_seconds), budget_seconds=given(self.budget_seconds),
            budget_spent=given(self.budget_spent), wait_seconds=self.wait_seconds,
            final_versions=list(self.final_versions),
            eval=given(None if self.eval is None else dict(self.eval)))

    @classmethod
    def from_json(cls, data: JSON) -> WorkerResult:
        return msgspec.convert(data, type=cls)

    @classmethod
    def read(cls, path: str | Path) -> WorkerResult:
        """A ``results/worker<r>.json``."""
        return cls.from_json(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class PushCounts:
    """A worker's pushes so far, and how many every shard accepted or some shard rejected."""

    pushes: int = 0
    accepted: int = 0
    rejected: int = 0

    def add(self, accepted: bool) -> PushCounts:
        return PushCounts(self.pushes + 1, self.accepted + accepted, self.rejected + (not accepted))

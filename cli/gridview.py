"""The progress bar of ``paramserver experiment`` and ``simulate``: an experiment observer
drawn with rich. Apart from grid.py (the flags), which imports it only when a grid runs,
so that ``--help`` loads neither rich nor the experiment runner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paramserver.workers.experiments.runner import ExperimentObserver, RunOutcome
from paramserver.workers.experiments.spec import RunPlan
from paramserver.workers.launch.clusterspec import Progress as ClusterProgress

if TYPE_CHECKING:
    from rich.progress import Progress

__all__ = ["RichObserver"]


class RichObserver(ExperimentObserver):
    """One progress bar over the grid, counted in worker steps."""

    def __init__(self, progress: Progress, total_steps: int, runs: int) -> None:
        self.progress = progress
        self.task = progress.add_task("starting", total=total_steps)
        self.runs = runs
        self.base = 0  # steps of the runs already finished
        self.steps = 0  # steps of the current run

    def run_started(self, index: int, total: int, plan: RunPlan, steps: int) -> None:
        self.steps = steps
        self.progress.update(self.task, description=f"[{index + 1}/{total}] {plan.name}",
                             completed=self.base)

    def run_progress(self, plan: RunPlan, progress: ClusterProgress) -> None:
        self.progress.update(self.task, completed=self.base + min(progress.done_steps,
                                                                  self.steps))

    def run_finished(self, outcome: RunOutcome) -> None:
        self.base += self.steps
        self.progress.update(self.task, completed=self.base)
        if not outcome.ok:
            self.progress.console.print(f"[red]run {outcome.plan.name} failed:[/red] "
                                        f"{outcome.error}")

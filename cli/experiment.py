"""``paramserver experiment``: run a grid of local runs and write a report.

Only argument handling and display live here; the work is done by
:mod:`workers.experiment` and :mod:`workers.report`.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from paramserver.errors import ConfigError, ParamServerError
from paramserver.optim import parse_kwargs
from workers.cluster import Progress as ClusterProgress
from workers.experiment import (
    PRESETS,
    SCENARIOS,
    ExperimentObserver,
    ExperimentSpec,
    RunOutcome,
    RunPlan,
    load_spec,
    run_experiment,
)
from workers.report import ReportFiles
from workers.report_render import summary_rows

__all__ = ["experiment"]

log = logging.getLogger(__name__)


class _RichObserver(ExperimentObserver):
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


def _kv(items: tuple[str, ...]) -> dict[str, Any]:
    return parse_kwargs(list(items))


def _seeds(text: str) -> int | list[int]:
    """``3`` (seeds 0, 1, 2) or a comma list ``0,5,7``."""
    try:
        if "," in text:
            return [int(s) for s in text.split(",") if s.strip()]
        return int(text)
    except ValueError as exc:
        raise ConfigError(f"--seeds takes a count (3) or a list (0,5,7), got {text!r}") from exc


def build_spec(*, spec_file: str | None, preset_name: str | None,
               overrides: dict[str, Any]) -> ExperimentSpec:
    """Flags override the spec file (or preset), which overrides the defaults."""
    if spec_file and preset_name:
        raise ConfigError("give --spec or --preset, not both")
    given = {k: v for k, v in overrides.items() if v not in (None, (), [], {})}
    if spec_file:
        return load_spec(spec_file, **given)
    base = dict(PRESETS[preset_name]) if preset_name else {}
    return ExperimentSpec.from_dict({**base, **given})


def _print_summary(console: Console, files: ReportFiles) -> None:
    scenarios = list(dict.fromkeys(s.scenario for s in files.summaries))
    for scenario in scenarios:
        head, rows = summary_rows([s for s in files.summaries if s.scenario == scenario])
        table = Table(title=f"Scenario '{scenario}': medians over seeds", title_justify="left")
        for i, name in enumerate(head):
            table.add_column(name, justify="left" if i == 0 else "right", no_wrap=i == 0)
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for claim in files.claims:
        color = {"pass": "green", "fail": "red"}.get(claim.status, "yellow")
        console.print(f"[{color}]{claim.status.upper()}[/{color}] {claim.claim}")
        console.print(f"    {claim.detail}", style="dim")


@click.command("experiment")
@click.option("--mode", "modes", multiple=True, metavar="MODE",
              help="sync, sync:b=B (B backup workers), async or ssp:S (repeatable). "
                   "Default: sync, async, ssp:3.")
@click.option("--policy", "policies", multiple=True, metavar="NAME[:k=v,...]",
              help="Staleness policy with arguments, e.g. reject:max_staleness=4 or "
                   "mypkg.policies:MyPolicy:factor=0.5 (repeatable). Default: none.")
@click.option("--workers", "workers", multiple=True, type=click.IntRange(min=1),
              help="Number of workers (repeatable). Default: 4.")
@click.option("--servers", type=click.IntRange(min=1), help="Number of shard servers "
              "(default 2).")
@click.option("--scenario", "scenarios", multiple=True, metavar="NAME",
              help=f"Straggler scenario (repeatable): {', '.join(SCENARIOS)}, or one defined "
                   "in the --spec file. Default: transient.")
@click.option("--seeds", help="How many seeds (3: seeds 0, 1, 2) or a list (0,5,7).")
@click.option("--steps", type=click.IntRange(min=1), help="Steps per worker (default 250).")
@click.option("--task", help="Task name or module:function (default digits-mlp).")
@click.option("--task-arg", "task_args", multiple=True, metavar="KEY=VALUE",
              help="Task argument (repeatable).")
@click.option("--optimizer", help="Server optimizer: sgd, adam, ... or module:Class "
              "(default sgd).")
@click.option("--optimizer-arg", "optimizer_args", multiple=True, metavar="KEY=VALUE",
              help="Optimizer argument (repeatable; default lr=0.1).")
@click.option("--target-loss", type=float, help="Held-out loss for 'time to target' "
              "(default 0.5).")
@click.option("--eval-every", type=click.IntRange(min=1),
              help="Worker 0 evaluates held-out data every N steps (default 5).")
@click.option("--min-step-time", type=click.FloatRange(min=0),
              help="Seconds every step takes at least: emulates a heavier model "
                   "(default 0.015).")
@click.option("--spec", "spec_file", type=click.Path(exists=True, dir_okay=False),
              help="TOML spec file (docs/experiments.md); flags override its keys.")
@click.option("--preset", "preset_name", type=click.Choice(sorted(PRESETS)),
              help="A named spec: demo (make demo), literature, scenarios.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Experiment directory (default runs/<name>). An earlier experiment "
                   "there is replaced.")
@click.option("--quiet", is_flag=True, help="No progress bar and no summary table.")
@click.option("--assert-literature", is_flag=True,
              help="Exit with status 1 unless the results agree with Ho et al. 2013 and "
                   "Cui et al. 2014 (see docs/experiments.md).")
def experiment(modes: tuple[str, ...], policies: tuple[str, ...], workers: tuple[int, ...],
               servers: int | None, scenarios: tuple[str, ...], seeds: str | None,
               steps: int | None, task: str | None, task_args: tuple[str, ...],
               optimizer: str | None, optimizer_args: tuple[str, ...],
               target_loss: float | None, eval_every: int | None,
               min_step_time: float | None, spec_file: str | None, preset_name: str | None,
               out_dir: str | None, quiet: bool, assert_literature: bool) -> None:
    """Compare sync, async and bounded-staleness training on one task.

    Runs every combination of scenario x mode x policy x worker count for every
    seed, with identical seeds and data, then writes report.md and report.html
    (tables and plots) into the experiment directory.
    """
    console = Console(stderr=False)
    try:
        spec = build_spec(spec_file=spec_file, preset_name=preset_name, overrides={
            "modes": list(modes), "policies": list(policies), "workers": list(workers),
            "servers": servers, "scenarios": list(scenarios),
            "seeds": _seeds(seeds) if seeds else None, "steps": steps, "task": task,
            "task_args": _kv(task_args), "optimizer": optimizer,
            "optimizer_args": _kv(optimizer_args), "target_loss": target_loss,
            "eval_every": eval_every, "min_step_time": min_step_time,
        })
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    out = Path(out_dir) if out_dir else Path("runs") / spec.name
    plans = spec.runs()
    if not quiet:
        console.print(f"{len(spec.configurations())} configuration(s) x {len(spec.seeds)} "
                      f"seed(s) = {len(plans)} runs of {spec.task} -> {out}")
    total_steps = sum(spec.steps * p.config.workers for p in plans)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("steps"), TimeElapsedColumn(), TimeRemainingColumn())
    try:
        with Progress(*columns, console=console, disable=quiet, transient=False) as bar:
            observer = _RichObserver(bar, total_steps, len(plans))
            result = run_experiment(spec, out, observer)
    except ParamServerError as exc:
        raise click.ClickException(str(exc)) from exc
    files = result.report
    assert files is not None
    if not quiet:
        _print_summary(console, files)
    console.print(f"report: {files.markdown} (and {files.html.name})")
    failed = result.failed
    if failed:
        console.print(f"[red]{len(failed)} of {len(plans)} runs failed[/red]; see the report")
    bad = [c for c in files.claims if c.status == "fail"]
    if assert_literature:
        if all(c.status == "skipped" for c in files.claims):
            console.print("[red]--assert-literature: nothing to check[/red]; use "
                          "--preset literature (transient and none scenarios, sync/ssp/async)")
            sys.exit(1)
        for claim in bad:
            console.print(f"[red]literature claim violated:[/red] {claim.claim}: "
                          f"{claim.detail}")
        if bad:
            sys.exit(1)
    if failed:
        sys.exit(2)

"""``paramserver simulate``: an experiment grid in virtual time, 64 workers and beyond.

The grid, the run directory and the report are those of ``paramserver
experiment`` (same flags, same spec files and presets); each run is simulated
in this process by :mod:`paramserver.simulator` instead of started as
processes. Only argument handling and display live here.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

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

from cli.experiment import _kv, _print_summary, _RichObserver, _seeds, build_spec
from paramserver.errors import ConfigError, ParamServerError
from paramserver.simulator import SimSpec, simulate_experiment
from workers.experiment import PRESETS, SCENARIOS

__all__ = ["simulate"]

log = logging.getLogger(__name__)


@click.command("simulate")
@click.option("--mode", "modes", multiple=True, metavar="MODE",
              help="sync, sync:b=B (B backup workers), async or ssp:S (repeatable). "
                   "Default: sync, async, ssp:3.")
@click.option("--policy", "policies", multiple=True, metavar="NAME[:k=v,...]",
              help="Staleness policy with arguments, e.g. gap-aware, dc-asgd:lam=0.1, "
                   "ssp-adaptive:s_min=1,s_max=8 (repeatable). Default: none.")
@click.option("--workers", "workers", multiple=True, type=click.IntRange(min=1),
              help="Number of virtual workers (repeatable), e.g. --workers 8 --workers 64. "
                   "Default: 4.")
@click.option("--servers", type=click.IntRange(min=1), help="Number of shards (default 2).")
@click.option("--scenario", "scenarios", multiple=True, metavar="NAME",
              help=f"Straggler scenario (repeatable): {', '.join(SCENARIOS)}, or one defined "
                   "in the --spec file. Default: transient.")
@click.option("--seeds", help="How many seeds (3: seeds 0, 1, 2) or a list (0,5,7).")
@click.option("--steps", type=click.IntRange(min=1),
              help="Steps per worker (default: as paramserver experiment).")
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
              help="Virtual seconds every step takes at least (default 0.015).")
@click.option("--compute-time", type=click.FloatRange(min=0), default=0.01, show_default=True,
              help="Virtual seconds of a step's bare compute; the scenario's stragglers "
                   "apply on top, as StragglerSpec.step_time does for a real worker.")
@click.option("--latency", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Virtual seconds each message (pull, push, reply) takes one way.")
@click.option("--spec", "spec_file", type=click.Path(exists=True, dir_okay=False),
              help="TOML spec file (docs/experiments.md); flags override its keys.")
@click.option("--preset", "preset_name", type=click.Choice(sorted(PRESETS)),
              help="A named experiment spec (see paramserver experiment --help).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Experiment directory (default runs/<name>-sim). An earlier experiment "
                   "there is replaced.")
@click.option("--quiet", is_flag=True, help="No progress bar and no summary table.")
def simulate(modes: tuple[str, ...], policies: tuple[str, ...], workers: tuple[int, ...],
             servers: int | None, scenarios: tuple[str, ...], seeds: str | None,
             steps: int | None, task: str | None, task_args: tuple[str, ...],
             optimizer: str | None, optimizer_args: tuple[str, ...],
             target_loss: float | None, eval_every: int | None,
             min_step_time: float | None, compute_time: float, latency: float,
             spec_file: str | None, preset_name: str | None, out_dir: str | None,
             quiet: bool) -> None:
    """Run an experiment grid in virtual time, in this process.

    The same shard core, optimizers, policies and tasks as real runs; every
    worker's step takes virtual time drawn from its straggler scenario. Writes
    the same logs and the same report.md / report.html as `paramserver
    experiment`, with times in virtual seconds (docs/research.md).
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
        sim = SimSpec(compute_time=compute_time, latency=latency)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    out = Path(out_dir) if out_dir else Path("runs") / f"{spec.name}-sim"
    plans = spec.runs()
    if not quiet:
        console.print(f"{len(spec.configurations())} configuration(s) x {len(spec.seeds)} "
                      f"seed(s) = {len(plans)} simulated runs of {spec.task} -> {out}")
    total_steps = sum(spec.steps * p.config.workers for p in plans)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("steps"), TimeElapsedColumn(), TimeRemainingColumn())
    try:
        with Progress(*columns, console=console, disable=quiet, transient=False) as bar:
            observer = _RichObserver(bar, total_steps, len(plans))
            result = simulate_experiment(spec, out, sim, observer)
    except ParamServerError as exc:
        raise click.ClickException(str(exc)) from exc
    files = result.report
    assert files is not None
    if not quiet:
        _print_summary(console, files)
    console.print(f"report: {files.markdown} (and {files.html.name}); times are virtual")
    if result.failed:
        console.print(f"[red]{len(result.failed)} of {len(plans)} runs failed[/red]; "
                      "see the report")
        sys.exit(2)

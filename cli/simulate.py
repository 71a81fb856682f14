"""``paramserver simulate``: an experiment grid in virtual time, 64 workers and beyond.

The grid, the run directory and the report are those of ``paramserver
experiment`` (same flags, same spec files and presets); each run is simulated
in this process by :mod:`paramserver.workers.launch.virtual` instead of started as
processes. Only argument handling and display live here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from paramserver.cli.grid import claim_grid_dir, grid_options, run_grid, spec_from_flags
from paramserver.errors import ConfigError

__all__ = ["simulate"]


EPILOG = """\b
Examples:
  # async with 64 virtual workers against 8, in seconds instead of hours
  paramserver simulate --mode async --mode ssp:3 --workers 8 --workers 64 --steps 30 \\
      --seeds 2 --out runs/async-sim
\b
  # a policy of your own at scale, against none
  paramserver simulate --mode async --workers 32 --policy none \\
      --policy mypkg.policies:Linear:horizon=4 --steps 30
\b
  # a preset, with 2 ms of virtual latency per message
  paramserver simulate --preset large-batch --latency 0.002 --overwrite
\b
Takes every flag of `paramserver experiment` and writes the same report, with
times in virtual seconds. See docs/research.md.
"""


@click.command("simulate", epilog=EPILOG,
               short_help="Run an experiment grid in virtual time, in this process.")
@grid_options(virtual=True)
@click.option("--compute-time", type=click.FloatRange(min=0), default=0.01, show_default=True,
              help="Virtual seconds of a step's bare compute; the scenario's stragglers "
                   "apply on top, as StragglerSpec.step_time does for a real worker.")
@click.option("--latency", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Virtual seconds each message (pull, push, reply) takes one way.")
def simulate(compute_time: float, latency: float, **flags: Any) -> None:
    """Run an experiment grid in virtual time, in this process.

    The same shard core, optimizers, policies and tasks as real runs; every
    worker's step takes virtual time drawn from its straggler scenario. Writes
    the same logs and the same report.md / report.html as `paramserver
    experiment`, with times in virtual seconds (docs/research.md).
    """
    from paramserver.cli.progress import cli_console  # here, not at the top: --help stays light
    from paramserver.workers.experiments.runner import simulate_experiment
    from paramserver.workers.launch.virtual import SimSpec, check_simulable

    console = cli_console(stderr=False)
    try:
        spec = spec_from_flags(flags)
        sim = SimSpec(compute_time=compute_time, latency=latency)
        plans = spec.runs()
        if plans:
            check_simulable(spec.cluster_spec(plans[0].config, plans[0].seed))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    out = claim_grid_dir(flags, Path("runs") / f"{spec.name}-sim")
    result = run_grid(console, spec, out, flags["quiet"], "simulated runs",
                      lambda observer: simulate_experiment(spec, out, sim, observer))
    files = result.report
    assert files is not None
    console.print(f"report: {files.markdown} (and {files.html.name}); times are virtual")
    if result.failed:
        console.print(f"[red]{len(result.failed)} of {len(spec.runs())} runs failed[/red]; "
                      "see the report")
        sys.exit(2)

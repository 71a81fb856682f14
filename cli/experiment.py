"""``paramserver experiment``: run a grid of local runs and write a report.

Only argument handling and display live here; the work is done by
:mod:`paramserver.workers.experiments.spec` and :mod:`paramserver.workers.experiments.report`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from paramserver.cli.grid import build_spec, claim_grid_dir, grid_options, run_grid, spec_from_flags
from paramserver.errors import ConfigError

__all__ = ["build_spec", "experiment"]


EPILOG = """\b
Examples:
  # the demo: sync, async and ssp:3 with 4 workers, 3 seeds (what `make demo` runs)
  paramserver experiment --preset demo --out runs/demo
\b
  # your own grid: three modes, two worker counts, a straggler scenario, 2 seeds
  paramserver experiment --mode sync --mode async --mode ssp:3 --workers 2 --workers 4 \\
      --num-servers 1 --scenario persistent --seeds 2 --steps 200 --out runs/grid
\b
  # a spec file, one key overridden; run again into the same folder
  paramserver experiment --spec grid.toml --steps 50 --overwrite
\b
  # a network straggler: 4 worker hosts and 2 server hosts at 400 Mbit/s, worker
  # host 3 at 100 Mbit/s (emulated hosts: Linux, as root; docs/experiments.md)
  paramserver experiment --mode sync --mode async --mode ssp:2 --scenario none \\
      --hosts 4+2 --link 400mbit --link-of 3=100mbit --steps 100 --seeds 1
\b
  # check the published claims (Ho et al. 2013, Cui et al. 2014)
  paramserver experiment --preset literature --assert-literature
\b
  # your own script (DistributedOptimizer) as every worker of every cell
  paramserver experiment --mode sync --mode async --mode ssp:2 --workers 2 \\
      --scenario persistent --seeds 2 --steps 100 --out runs/mine \\
      -- python train.py --lr 0.1
\b
After "--", COMMAND runs once per worker of every cell, as `launch -- COMMAND`
runs it, with RANK, WORLD_SIZE, PARAMSERVER_SEED (the cell's seed),
PARAMSERVER_CELL (its folder under OUT/runs/), PARAMSERVER_STEPS (--steps,
a hint: the script owns its loop) and PARAMSERVER_EVALUATOR (--evaluator; by
default the lowest rank the scenario does not slow) set. --task, --task-arg, --eval-every and
the budgets are refused with it. The key `command` of a spec file does the same.
\b
Writes OUT/report.md and OUT/report.html (tables and plots), OUT/spec.toml (the
resolved spec: --spec OUT/spec.toml reruns it), and every run's logs under
OUT/runs/. Exit codes: 0 done, 1 --assert-literature failed, 2 bad options or
a run failed. See docs/experiments.md.
"""


@click.command("experiment", epilog=EPILOG,
               short_help="Compare sync, async and bounded-staleness training on a task or script.")
@grid_options(virtual=False)
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="[-- COMMAND [ARGS]...]")
@click.option("--assert-literature", is_flag=True,
              help="Exit with status 1 unless the results agree with Ho et al. 2013 and "
                   "Cui et al. 2014 (see docs/experiments.md).")
@click.option("--trace", is_flag=True,
              help="Record every run's pushes in its trace/ folder, for `paramserver "
                   "simulate --replay` (docs/research.md).")
@click.option("--paired", is_flag=True,
              help="Compare policies on the same schedules: trace every run, replay each "
                   "seed's run of the first --policy with every other one, and report the "
                   "paired differences with their confidence intervals beside the unpaired "
                   "ones (OUT/paired.md; docs/research.md).")
def experiment(assert_literature: bool, trace: bool, paired: bool, **flags: Any) -> None:
    """Compare sync, async and bounded-staleness training on one task or script.

    Runs every combination of scenario x mode x policy x worker count for every
    seed, with identical seeds and data, then writes report.md and report.html
    (tables and plots) into the experiment directory. After `--`, your own
    script (on DistributedOptimizer) runs as each worker instead of a task.
    """
    from paramserver.cli.progress import cli_console  # here, not at the top: --help stays light
    from paramserver.workers.experiments.runner import run_experiment

    console = cli_console(stderr=False)
    try:
        spec = spec_from_flags(flags)
        if paired and len(spec.policies) < 2:
            raise ConfigError("--paired compares policies: give at least two --policy (the "
                              "first is the baseline the others are replayed against)")
        if (trace or paired) and spec.command:
            raise ConfigError("--trace and --paired replay the built-in loop's gradients: "
                              "not with a command (after --)")
        if trace or paired:  # what a trace cannot hold is refused now, not run by run
            import dataclasses

            for plan in spec.runs():
                dataclasses.replace(spec.cluster_spec(plan.config, plan.seed), trace=True)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    if spec.hosts is not None:
        from paramserver.cli.launch import hosts_here

        hosts_here()
    out = claim_grid_dir(flags, Path("runs") / spec.name)
    result = run_grid(console, spec, out, flags["quiet"], "runs",
                      lambda observer: run_experiment(spec, out, observer,
                                                      trace=trace or paired))
    files = result.report
    assert files is not None
    plans = spec.runs()
    console.print(f"report: {files.markdown} (and {files.html.name})")
    failed = result.failed
    if paired and not failed:
        _paired(console, spec, out)
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


def _paired(console: Any, spec: Any, out: Path) -> None:
    """Replay each baseline run with the other policies; print the intervals side by side."""
    from paramserver.errors import ParamServerError
    from paramserver.workers.experiments.paired import paired_report

    console.print("paired: replaying each seed's baseline run with the other policies ...")
    try:
        rows = paired_report(spec, out, lambda line: console.print(f"  {line}", style="dim"))
    except ParamServerError as exc:
        raise click.ClickException(str(exc)) from exc
    if len(spec.seeds) < 2:
        console.print("  one seed: no confidence interval (give --seeds 2 or more)")
    for r in rows:
        console.print(f"  {r.config}: {r.policy} - {r.baseline}: paired "
                      f"{r.paired_mean:+.4f} ± {r.paired_half:.4f}, unpaired "
                      f"{r.unpaired_mean:+.4f} ± {r.unpaired_half:.4f}: the paired interval "
                      f"is {r.ratio:.1f}x narrower (own runs paired by seed: "
                      f"± {r.seed_half:.4f}; {sum(r.reproduced)}/{len(r.reproduced)} "
                      f"baseline replays bit for bit)")
    console.print(f"paired report: {out / 'paired.md'} (plot: images/paired.png)")

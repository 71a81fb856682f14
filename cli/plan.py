"""``paramserver plan``: which mode reaches a target loss first, on a cluster not yet run.

Fits the simulator's model of time (compute per worker, the links' per-step and
per-byte costs, the shards' service time) from real runs' event logs and
simulates each mode on the configuration asked for
(:mod:`paramserver.workers.experiments.planner`). Only argument handling and
display live here.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from paramserver.cli import options
from paramserver.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console

    from paramserver.workers.experiments.planner import Plan, Range

__all__ = ["plan"]


EPILOG = """\b
Examples:
  # fit on a 2-worker run, then ask about 4 workers with one slow NIC
  paramserver launch --num-workers 2 --num-servers 1 --mode async --steps 300 \\
      --eval-every 5 --min-step-time 0.01 --hosts 2+1 --link 100mbit --out runs/fit
  paramserver plan --from runs/fit --workers 4 --link 100mbit --link-of 3=20mbit \\
      --mode sync --mode async --mode ssp:2 --mode diloco:4 --target-loss 0.5
\b
  # a run on loopback fits compute and per-step costs; --link adds plain NICs
  paramserver plan --from runs/loopback --workers 8 --link 1gbit --mode sync,async \\
      --straggler 7:slowdown=4 --target-loss 0.5 --json
\b
It prints what it fitted (and which per-mode costs were fitted on a run of that
mode, which taken from another mode's or timed here in-process: a local-SGD
round's own work), how well the fit predicts the runs it came from (its
in-sample error), and per mode the predicted time to the target loss, the
bytes every worker moved until then and the time its pulls were held at the
barrier or SSP gate: the median and the 10th-90th percentile
over the draws (the fit itself, then bootstrap replicates of it, each with
another seed). Hosts are numbered as `launch --hosts N+S` numbers them: workers
0 .. N-1, then the shards. Without --link the links are the fitted runs'. See
docs/research.md ("A calibrated what-if planner") for how close it came.
"""


def _launch_flag(name: str, help: str) -> Any:
    """``launch``'s option ``name`` (its type, parsing and metavar), with help that says
    what it means here."""
    spec = next(s for s in options.LAUNCH if s.name == name)
    return click.option(*spec.decls, **{**spec.kwargs, "envvar": None, "show_envvar": False,
                                         "help": help})


def _worker_flag(name: str) -> Any:
    """A worker option (cli/options.py's WORKER) as this command's flag: the same
    declaration and help, without its environment variable."""
    spec = next(s for s in options.WORKER if s.name == name)
    return click.option(*spec.decls, **{**spec.kwargs, "envvar": None, "show_envvar": False})


def _modes(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> list[str]:
    out = [m.strip() for v in value for m in v.split(",") if m.strip()]
    if not out:
        raise click.BadParameter("give at least one mode", ctx=ctx, param=param)
    return out


@click.command("plan", epilog=EPILOG,
               short_help="Predict each mode's time to a target loss, fitted on real runs.")
@click.option("--from", "runs", multiple=True, required=True, metavar="RUN",
              type=click.Path(file_okay=False),
              help="A run directory (--out of launch or run) to fit the model of time on "
                   "(repeatable: the fit takes them all).")
@click.option("--workers", "-n", type=click.IntRange(min=1), default=None, metavar="N",
              help="Workers to predict for [default: the first run's].")
@_launch_flag("link", "Every NIC's rate, both ways, in tc's units (20mbit, 1gbit) [default: "
                      "the fitted runs' links].")
@_launch_flag("link_of", "Host HOST's NIC at RATE instead, e.g. 3=20mbit: a network straggler "
                         "(repeatable; workers are hosts 0 .. N-1, the shards N ...).")
@_launch_flag("stragglers", "Slow down one worker, on top of the fitted runs' scenario, e.g. "
                            "3:slowdown=3 or 2:delay=exp:0.05 (repeatable).")
@_worker_flag("compression")
@click.option("--mode", "modes", multiple=True, callback=_modes, default=("sync", "async"),
              show_default=True, metavar="MODE",
              help="sync, async, ssp:S, local:H (local SGD, H steps per push) or diloco:H "
                   "(repeatable, or comma-separated).")
@click.option("--target-loss", type=float, required=True, metavar="L",
              help="Held-out loss to reach; time to it is what is predicted.")
@click.option("--steps", type=click.IntRange(min=1), default=None, metavar="K",
              help="Steps per worker simulated [default: the first run's]; a mode that "
                   "does not reach the target within them says so.")
@click.option("--draws", type=click.IntRange(min=1), default=5, show_default=True, metavar="K",
              help="Simulations per configuration (the fit, then bootstrap replicates).")
@click.option("--json", "as_json", is_flag=True, help="Print the prediction as JSON.")
@click.option("--trust-plugins", is_flag=True, default=False,
              help="Import the plug-ins (module:name task, policy, optimizer or compressor) "
                   "the --from runs name. Without it a run that names one is refused: the "
                   "planner would run that module's code, and a run's folder holds files "
                   "anyone may have written. A plug-in given by a flag is imported either "
                   "way.")
def plan(runs: tuple[str, ...], workers: int | None, link: str | None,
         link_of: tuple[tuple[str, str], ...], modes: list[str], target_loss: float,
         steps: int | None, draws: int, as_json: bool, compression: str | None,
         trust_plugins: bool, **opts: Any) -> None:
    """Predict each mode's time to a target loss on a cluster you have not run.

    Fits, from real runs' event logs, each worker's compute times, the links'
    per-step and per-byte costs and the shards' time per push; then runs the
    virtual-time simulator (the real shard core, the real task) with them, per
    mode, several times. Prints a range, not a point, and the fit's error on the
    runs it came from.
    """
    from paramserver.compress.registry import compressor_name
    from paramserver.util.plugins import names_from

    # (a PUSH/PULL pair: a module path has no "/")
    allow = [compressor_name(c) for c in (compression or "").split("/") if c.strip()]
    with names_from("a --from run's result.json", trusted=trust_plugins, allow=allow):
        _plan(runs, workers, link, link_of, modes, target_loss, steps, draws, as_json,
              compression, **opts)


def _plan(runs: tuple[str, ...], workers: int | None, link: str | None,
          link_of: tuple[tuple[str, str], ...], modes: list[str], target_loss: float,
          steps: int | None, draws: int, as_json: bool, compression: str | None,
          **opts: Any) -> None:
    from paramserver.cli.progress import cli_console, step_progress
    from paramserver.workers.experiments.planfit import read_run
    from paramserver.workers.experiments.planner import (
        Target,
        configure_modes,
        make_plan,
        parse_plan_mode,
    )

    try:
        records = [read_run(r) for r in runs]
        plans = [parse_plan_mode(m) for m in modes]
        stragglers: dict[int, dict[str, Any]] = {}  # on top of the run's own scenario
        for key, value in opts["stragglers"]:
            rank, _, name = key.partition(":")
            stragglers.setdefault(int(rank), {})[name] = value
        target = Target(workers=workers, link=link,
                        link_of={int(h): r for h, r in link_of}, stragglers=stragglers,
                        steps=steps, compression=compression)
        target.per_byte()  # the rates, checked before anything runs
        configure_modes(records, plans, target)  # and the rest of the request
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    console = cli_console(stderr=True)
    total = draws * (len(records) + len(plans))  # (and the calibration's few runs, first)
    with step_progress(console, disable=as_json) as bar:
        task = bar.add_task("simulating", total=total)
        try:
            result = make_plan(records, plans, target, target_loss, draws,
                               on_draw=lambda: bar.advance(task))
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
        return
    show_plan(cli_console(stderr=False), result)


def _range(r: Range | None, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    if r is None:
        return "not reached"
    return (f"{fmt.format(r.mid * scale)} "
            f"({fmt.format(r.low * scale)}-{fmt.format(r.high * scale)})")


def show_plan(console: Console, result: Plan) -> None:
    """The fit, its in-sample error, the predictions and the ranking, as rich tables."""
    from rich.table import Table

    from paramserver.cli.tables import keep_figures

    fit = result.fit.summary()
    pooled = fit["compute_ms_pooled"]
    per_step = fit["link"]["per_step_ms"]
    fitted = set(fit["fitted_families"])
    source = fit["link"]["per_step_from"]
    wire = ", ".join(f"{per_step[f]:.3f} ms per {f} step"
                     + ("" if f in fitted else f" ({source[f]}'s: no {f} run fitted)")
                     for f in per_step)
    console.print(f"fitted: compute {pooled['p50']:.3f} ms median per gradient "
                  f"(p10 {pooled['p10']:.3f}, p90 {pooled['p90']:.3f}, mean "
                  f"{pooled['mean']:.3f}; {int(pooled['n'])} steps); on the wire {wire} + "
                  f"{result.fit.link.describe()}; shard {fit['service_ms']:.3f} ms per push")
    for mode, over in result.overheads.items():
        how = over.to_json()
        console.print(f"{mode}: {how['mean_ms']:.3f} ms per push besides its steps "
                      f"({how['source']})")
    checks = Table(title="the fit against the runs it came from (in-sample)")
    for name, justify in [("run", "left"), ("mode", "left"), ("N", "right"),
                          ("measured s", "right"), ("predicted s (p10-p90)", "right"),
                          ("error", "right"), ("held ms/push: run, model", "right")]:
        checks.add_column(name, justify=justify)  # type: ignore[arg-type]
    for c in result.checks:
        err = c.error
        checks.add_row(c.run, c.mode, str(c.workers),
                       "not reached" if c.measured is None else f"{c.measured:.2f}",
                       _range(c.predicted.time),
                       "-" if err is None else f"{err:+.0%}",
                       f"{c.wait * 1e3:.2f}, {c.predicted.to_json()['wait_ms_per_push']:.2f}")
    console.print(keep_figures(checks, console))
    table = Table(title=f"predicted for {result.workers} workers: time to held-out loss "
                        f"{result.target_loss:g}")
    for name, justify in [("rank", "right"), ("mode", "left"), ("seconds (p10-p90)", "right"),
                          ("MB moved, all workers", "right"), ("held ms/push", "right"),
                          ("reached", "right")]:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    tied = {a for a, _ in result.ties()}
    for i, mode in enumerate(result.ranking(), 1):
        p = result.predictions[mode]
        table.add_row(str(i), mode, _range(p.time), _range(p.traffic, 1e-6, "{:.1f}"),
                      f"{p.to_json()['wait_ms_per_push']:.2f}", f"{p.reached}/{len(p.times)}")
    console.print(keep_figures(table, console))
    if tied:
        pairs = ", ".join(f"{a} and {b}" for a, b in result.ties())
        console.print(f"too close to call (their ranges overlap): {pairs}")

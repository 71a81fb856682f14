"""What ``paramserver experiment`` and ``paramserver simulate`` share: the grid's
flags, building its spec, the progress bar and the summary tables."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

import click

from paramserver.cli import options as cli_options
from paramserver.cli.outdir import EXPERIMENT_MARKERS, claim_out_dir
from paramserver.core.stepsize import LR_SCALINGS
from paramserver.errors import ConfigError, ParamServerError
from paramserver.util.coerce import parse_kwargs

if TYPE_CHECKING:  # rich, the runner and its report load where a grid runs, not for --help
    from rich.console import Console

    from paramserver.workers.experiments.report import ReportFiles
    from paramserver.workers.experiments.runner import ExperimentObserver, ExperimentResult
    from paramserver.workers.experiments.spec import ExperimentSpec

__all__ = ["PRESET_NAMES", "SCENARIO_NAMES", "build_spec", "claim_grid_dir", "grid_options",
           "print_summary", "run_grid", "spec_from_flags"]

F = TypeVar("F", bound=Callable[..., Any])

# The names of workers.experiments.spec's PRESETS and SCENARIOS, which --preset and
# --scenario offer: that module loads torch, and --help should not wait for it (a test
# keeps these equal to the tables).
PRESET_NAMES: tuple[str, ...] = ("compression", "demo", "large-batch", "literature",
                                 "local-sgd", "momentum", "recsys", "scenarios")
SCENARIO_NAMES: tuple[str, ...] = ("none", "persistent", "transient", "heavy-tail")


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
    from paramserver.workers.experiments.spec import PRESETS, ExperimentSpec, load_spec

    if spec_file and preset_name:
        raise ConfigError("give --spec or --preset, not both")
    given = {k: v for k, v in overrides.items() if v not in (None, (), [], {})}
    if spec_file:
        return load_spec(spec_file, **given)
    base = dict(PRESETS[preset_name]) if preset_name else {}
    return ExperimentSpec.from_dict({**base, **given})


def spec_from_flags(flags: dict[str, Any]) -> ExperimentSpec:
    """The spec the :func:`grid_options` flags describe (ConfigError if they are bad)."""
    cli_options.take_deprecated(click.get_current_context(), flags, "--servers", "num_servers")
    command = list(flags.get("command") or ()) or None
    if command:  # a flag the script cannot honour says so (the spec checks values only)
        from paramserver.workers.experiments.spec import NOT_FOR_COMMANDS

        for name, flag in _NOT_FOR_COMMANDS.items():
            if flags[name] not in (None, ()):
                raise ConfigError(f"{flag} does not apply with a command (after --): "
                                  f"{NOT_FOR_COMMANDS[name]}")
    seeds = flags["seeds"]
    return build_spec(spec_file=flags["spec_file"], preset_name=flags["preset_name"],
                      overrides={
        "modes": list(flags["modes"]), "policies": list(flags["policies"]),
        "compressions": list(flags["compressions"]),
        "workers": list(flags["workers"]), "num_servers": flags["num_servers"],
        "scenarios": list(flags["scenarios"]), "seeds": _seeds(seeds) if seeds else None,
        "steps": flags["steps"], "task": flags["task"],
        "task_args": parse_kwargs(list(flags["task_args"])), "optimizer": flags["optimizer"],
        "optimizer_args": parse_kwargs(list(flags["optimizer_args"])),
        "target_loss": flags["target_loss"], "eval_every": flags["eval_every"],
        "evaluator": flags["evaluator"],
        "min_step_time": flags["min_step_time"], "lr_scaling": flags["lr_scaling"],
        "warmup_steps": flags["warmup_steps"], "momentum_target": flags["momentum_target"],
        "local_optimizer": flags["local_optimizer"],
        "local_args": parse_kwargs(list(flags["local_args"])),
        "outer_args": parse_kwargs(list(flags["outer_args"])),
        **_budgets(flags["budget_seconds"], flags["budget_gradients"]), "command": command,
        "hosts": flags.get("hosts"), "link": flags.get("link"),
        "link_of": dict(flags.get("link_of") or ()),
    })


#: the grid's flags of the built-in loop (a command is refused with them), by spec key
_NOT_FOR_COMMANDS = {"task": "--task", "task_args": "--task-arg", "eval_every": "--eval-every",
                     "budget_seconds": "--budget-seconds",
                     "budget_gradients": "--budget-gradients"}


def claim_grid_dir(flags: dict[str, Any], default: Path) -> Path:
    """The experiment folder (--out, else ``default``), made empty by the rule launch also
    follows (cli/outdir.py)."""
    out = Path(flags["out_dir"]) if flags["out_dir"] else default
    return claim_out_dir(out, what="experiment", markers=EXPERIMENT_MARKERS,
                         overwrite=flags["overwrite"])


class _Budgets(TypedDict):
    """The spec's budgets as the flags give them (None: not given, the spec's own)."""

    budget_seconds: float | None
    budget_gradients: int | None


def _budgets(seconds: float | None, gradients: int | None) -> _Budgets:
    """The budget flags; one given alone replaces the spec file's other budget (both
    given: the spec says that is one too many)."""
    if seconds and not gradients:
        return {"budget_seconds": seconds, "budget_gradients": 0}
    if gradients and not seconds:
        return {"budget_gradients": gradients, "budget_seconds": 0.0}
    return {"budget_seconds": seconds, "budget_gradients": gradients}


def grid_options(*, virtual: bool) -> Callable[[F], F]:
    """The grid's flags; ``virtual``: as ``simulate`` words them (virtual workers and time)."""
    worker_help = ("Number of virtual workers (repeatable), e.g. --workers 8 --workers 64. "
                   "Default: 4." if virtual else "Number of workers (repeatable). Default: 4.")
    step_time_help = ("Virtual seconds every step takes at least (default 0.015)." if virtual
                      else "Seconds every step takes at least: emulates a heavier model "
                           "(default 0.015).")
    default_out = "runs/<name>-sim" if virtual else "runs/<name>"
    options = [
        click.option("--mode", "modes", multiple=True, metavar="MODE",
                     help="sync, sync:b=B (B backup workers), async or ssp:S (repeatable); "
                          "h=H makes it local SGD (sync:h=32 is DiLoCo, "
                          "async:h=32,outer=delayed-nesterov). Default: sync, async, ssp:3."),
        click.option("--policy", "policies", multiple=True, metavar="NAME[:k=v,...]",
                     help="Staleness policy with arguments, e.g. reject:max_staleness=4, "
                          "gap-aware, dc-asgd:lam=0.1 or mypkg.policies:MyPolicy:factor=0.5 "
                          "(repeatable). Default: none."),
        click.option("--compression", "compressions", multiple=True, metavar="NAME[:k=v,...]",
                     help="The workers' push compression (repeatable: an axis), e.g. int8, "
                          "topk:ratio=0.01 or sign:ef=0; see `paramserver compressors`. "
                          "PUSH/PULL compresses the pulls too (--pull-compression), e.g. "
                          "int8/int8 or none/topk:ratio=0.01. Default: none."),
        click.option("--workers", "workers", multiple=True, type=click.IntRange(min=1),
                     help=worker_help),
        click.option("--num-servers", "-s", "num_servers", type=click.IntRange(min=1),
                     metavar="S",
                     help="Number of shard servers (default 2)."),
        cli_options.SERVERS_COUNT,
        click.option("--scenario", "scenarios", multiple=True, metavar="NAME",
                     help=f"Straggler scenario (repeatable): {', '.join(SCENARIO_NAMES)}, or one "
                          "defined in the --spec file. Default: transient."),
        click.option("--seeds", help="How many seeds (3: seeds 0, 1, 2) or a list (0,5,7)."),
        click.option("--steps", type=click.IntRange(min=1), help="Steps per worker "
                     "(default 250)." + ("" if virtual else " After -- COMMAND: the script's "
                                         "PARAMSERVER_STEPS, a hint (it owns its loop).")),
        click.option("--budget-seconds", type=click.FloatRange(min=0, min_open=True),
                     help=("Virtual seconds" if virtual else "Seconds")
                     + " of training per worker, from its first step, instead of --steps: "
                       "every mode ends at the same time (within one step)."),
        click.option("--budget-gradients", type=click.IntRange(min=1),
                     help="Gradients computed in total, instead of --steps: each of N "
                          "workers computes an equal share (a multiple of N), so every mode "
                          "computes the same total."),
        click.option("--task", help="Task name or module:function (default digits-mlp)."),
        click.option("--task-arg", "task_args", multiple=True, metavar="KEY=VALUE",
                     help="Task argument (repeatable)."),
        click.option("--optimizer", help="Server optimizer: sgd, adam, ... or module:Class "
                     "(default sgd)."),
        click.option("--optimizer-arg", "optimizer_args", multiple=True, metavar="KEY=VALUE",
                     help="Optimizer argument (repeatable; default lr=0.1)."),
        click.option("--lr-scaling", type=click.Choice(LR_SCALINGS),
                     help="Learning-rate rule for every mode: a step averaging k gradients "
                          "(a sync round) runs at k x lr (linear) or sqrt(k) x lr (sqrt); "
                          "a mode may set its own (sync:lr=linear). Default: none."),
        click.option("--warmup-steps", type=click.IntRange(min=0),
                     help="With --lr-scaling: reach the full factor over the first N steps "
                          "(default 0; a mode may set its own: sync:lr=linear,warmup=N)."),
        click.option("--momentum-target", type=click.FloatRange(min=0, max=1, max_open=True),
                     help="Asynchrony-aware momentum: total momentum, explicit plus the "
                          "implicit momentum of staleness (a mode may set its own: "
                          "async:target=0.9)."),
        click.option("--local-optimizer", metavar="NAME",
                     help="Local SGD (modes with h=H): every worker's inner optimizer "
                          "(default adamw)."),
        click.option("--local-arg", "local_args", multiple=True, metavar="KEY=VALUE",
                     help="Inner optimizer argument (repeatable; default lr=0.001)."),
        click.option("--outer-arg", "outer_args", multiple=True, metavar="KEY=VALUE",
                     help="Local SGD's outer (server) optimizer argument, for the modes "
                          "with h=H (repeatable; default lr=0.7, momentum=0.9, "
                          "nesterov=true: DiLoCo's; given ones replace them all)."),
        click.option("--target-loss", type=float, help="Held-out loss for 'time to target' "
                     "(default 0.5)."),
        click.option("--eval-every", type=click.IntRange(min=1),
                     help="The evaluator evaluates held-out data every N steps (default 5)."),
        click.option("--evaluator", type=click.IntRange(min=0), metavar="RANK",
                     help="The worker that evaluates held-out data in every cell (a "
                          "script finds it as PARAMSERVER_EVALUATOR). Default: the lowest "
                          "rank the scenario does not slow."),
        click.option("--min-step-time", type=click.FloatRange(min=0), help=step_time_help),
        click.option("--spec", "spec_file", type=click.Path(exists=True, dir_okay=False),
                     help="TOML spec file (docs/experiments.md); flags override its keys."),
        click.option("--preset", "preset_name", type=click.Choice(PRESET_NAMES),
                     help="A named spec: demo (make demo), literature, scenarios, large-batch, "
                          "momentum, recsys, local-sgd."),
        click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
                     help=f"Experiment directory (default {default_out}); must be new "
                          "or empty unless --overwrite is given."),
        cli_options.OVERWRITE,
        click.option("--quiet", is_flag=True, help="No progress bar and no summary table."),
    ]
    if not virtual:  # real processes only: a simulation's network is its time model
        options[-5:-5] = cli_options.HOST_FLAGS  # (before --spec)

    def decorate(fn: F) -> F:
        for option in reversed(options):
            fn = option(fn)
        return fn
    return decorate


def print_summary(console: Console, files: ReportFiles) -> None:
    from rich.table import Table

    from paramserver.cli.tables import keep_figures
    from paramserver.workers.experiments.render import summary_rows

    scenarios = list(dict.fromkeys(s.scenario for s in files.summaries))
    for scenario in scenarios:
        head, rows = summary_rows([s for s in files.summaries if s.scenario == scenario])
        table = Table(title=f"Scenario '{scenario}': medians over seeds", title_justify="left")
        for i, name in enumerate(head):
            table.add_column(name, justify="left" if i == 0 else "right", no_wrap=i == 0)
        for row in rows:
            table.add_row(*row)
        console.print(keep_figures(table, console))
    for claim in files.claims:
        color = {"pass": "green", "fail": "red"}.get(claim.status, "yellow")
        console.print(f"[{color}]{claim.status.upper()}[/{color}] {claim.claim}")
        console.print(f"    {claim.detail}", style="dim")


def run_grid(console: Console, spec: ExperimentSpec, out: Path, quiet: bool, what: str,
             run: Callable[[ExperimentObserver], ExperimentResult]) -> ExperimentResult:
    """Run the grid (``run`` given the progress observer), showing progress and the summary."""
    from paramserver.cli.gridview import RichObserver
    from paramserver.cli.progress import step_progress

    plans = spec.runs()
    if not quiet:
        console.print(f"{len(spec.configurations())} configuration(s) x {len(spec.seeds)} "
                      f"seed(s) = {len(plans)} {what} of {spec.workload} -> {out}")
    # gradients computed, as each run's progress counts them (with local SGD a push
    # holds H of them)
    total_steps = sum((spec.worker_steps(p.config.workers) or spec.steps) * p.config.workers
                      for p in plans)
    try:
        with step_progress(console, "steps", disable=quiet) as bar:
            result = run(RichObserver(bar, total_steps, len(plans)))
    except ParamServerError as exc:
        raise click.ClickException(str(exc)) from exc
    assert result.report is not None
    if not quiet:
        print_summary(console, result.report)
    return result

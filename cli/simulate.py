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
  # replay a traced run (launch --trace) on the real core: its own policy gives its
  # final weights bit for bit; another gives the paired counterfactual
  paramserver simulate --replay runs/traced --policy inverse --policy none
\b
Takes every flag of `paramserver experiment` and writes the same report, with
times in virtual seconds. See docs/research.md.
"""

#: what --replay may change (the flags' dests); the schedule is the trace's
_REPLAY_FLAGS = {"policies", "optimizer", "optimizer_args", "compressions", "modes", "out_dir",
                 "quiet", "overwrite"}


@click.command("simulate", epilog=EPILOG,
               short_help="Run an experiment grid in virtual time, in this process.")
@grid_options(virtual=True)
@click.option("--compute-time", type=click.FloatRange(min=0), default=0.01, show_default=True,
              help="Virtual seconds of a step's bare compute; the scenario's stragglers "
                   "apply on top, as StragglerSpec.step_time does for a real worker.")
@click.option("--latency", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Virtual seconds each message (pull, push, reply) takes one way.")
@click.option("--replay", "replay_dir", type=click.Path(file_okay=False),
              metavar="TRACE", default=None,
              help="Re-run a traced run (launch/run/experiment --trace; its run directory "
                   "or its trace/) on the real core: the recorded policy reproduces its "
                   "final weights bit for bit; --policy, --optimizer, --optimizer-arg, "
                   "--compression or --mode ssp:S give the counterfactual on the same "
                   "schedule (one replay per --policy).")
@click.option("--trust-plugins", is_flag=True, default=False,
              help="--replay: import the plug-ins (module:name task, policy, optimizer or "
                   "compressor) the trace names. Without it a trace that names one is "
                   "refused: the replay would run that module's code, and a trace is a "
                   "file anyone may have written. Plug-ins given by flags are imported "
                   "either way.")
def simulate(compute_time: float, latency: float, replay_dir: str | None,
             trust_plugins: bool, **flags: Any) -> None:
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
    if replay_dir is not None:
        _replay(console, Path(replay_dir), flags, trust_plugins)
        return
    if trust_plugins:
        raise click.UsageError("--trust-plugins applies to --replay (a trace's plug-ins)")
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


def _changes(flags: dict[str, Any]) -> list[Any]:
    """The counterfactuals --replay's flags ask for (none: the recorded run's own)."""
    from paramserver.util.coerce import parse_kwargs
    from paramserver.workers.experiments.axes import ModeChoice, PolicyChoice
    from paramserver.workers.launch.replay import Changes

    ctx = click.get_current_context()
    given = [name for name, value in flags.items() if value not in (None, (), [], False)
             and ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]
    extra = sorted(set(given) - _REPLAY_FLAGS)
    if extra:
        raise ConfigError(f"--replay re-runs a recorded schedule; it takes --policy, "
                          f"--optimizer, --optimizer-arg, --compression and --mode ssp:S, not "
                          f"{', '.join('--' + e.replace('_', '-') for e in extra)}")
    bound = None
    for mode in flags["modes"]:
        choice = ModeChoice.parse(mode)
        if choice.mode != "ssp":
            raise ConfigError(f"--replay follows the recorded mode; --mode may only change "
                              f"an ssp run's bound (ssp:S), not {mode!r}")
        bound = choice.bound
    common = {"optimizer": flags["optimizer"],
              "optimizer_args": parse_kwargs(list(flags["optimizer_args"])) or None,
              "staleness_bound": bound}
    policies: list[PolicyChoice | None] = [PolicyChoice.parse(p) for p in flags["policies"]]
    policies = policies or [None]
    compressions: list[str | None] = list(flags["compressions"]) or [None]
    return [Changes(policy=None if p is None else p.name,
                    policy_args=None if p is None else dict(p.args), compression=c, **common)
            for p in policies for c in compressions]


def _replay(console: Any, directory: Path, flags: dict[str, Any], trust_plugins: bool) -> None:
    import json

    from paramserver.errors import ParamServerError
    from paramserver.observe.trace import read_trace_dir
    from paramserver.workers.launch.replay import compare, final_weights, replay

    try:
        changes = _changes(flags)
        trace = read_trace_dir(directory)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    run_dir = trace.directory.parent if trace.directory.name == "trace" else trace.directory
    real = None
    if (run_dir / "final_model.safetensors").exists():
        real = final_weights(run_dir)
    console.print(f"replaying {trace.pushes()} pushes of {len(trace.workers)} workers on "
                  f"{len(trace.shards)} shard(s) from {trace.directory}")
    report = []
    for change in changes:
        try:
            result = replay(trace, change, trust_plugins=trust_plugins)
        except ParamServerError as exc:
            raise click.ClickException(str(exc)) from exc
        loss = result.eval.get("loss")
        line = f"{result.changes}: final held-out loss {loss:.6f}" if loss is not None \
            else f"{result.changes}:"
        if real is not None:
            equal, worst = compare(result.weights, real)
            line += ("; final weights bit for bit the run's" if equal
                     else f"; final weights differ from the run's (max |diff| {worst:.3g})")
        console.print(line)
        console.print(f"  {result.note}", style="dim")
        report.append(result.to_json())
    if flags["out_dir"]:
        out = Path(flags["out_dir"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "replay.json").write_text(json.dumps(report, indent=2))
        console.print(f"written: {out / 'replay.json'}")

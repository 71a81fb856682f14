"""``paramserver launch``: a whole local cluster for one run."""

from __future__ import annotations

import collections
import dataclasses
import json
import shlex
import signal
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from paramserver.errors import ParamServerError
from paramserver.util.jsontypes import JSON, JSONObject
from paramserver.util.proctitle import set_title
from paramserver.workers.launch.clusterspec import ClusterSpec, parse_reshard_items
from paramserver.workers.launch.clusterspec import Progress as ClusterProgress
from paramserver.workers.launch.processes import ProcessInfo

from . import options
from .outdir import RUN_MARKERS, claim_out_dir
from .workercount import agree_worker_count

if TYPE_CHECKING:  # rich and the run's records load where a cluster runs, not for --help
    from rich.console import Console
    from rich.progress import Progress

    from paramserver.workers.launch.results import ClusterResult

__all__ = ["launch"]

EPILOG = """\b
Examples:
  # 2 shards, 3 workers, synchronous training of digits-mlp
  paramserver launch -s 2 -n 3 --mode sync --steps 150 --out runs/sync
\b
  # bounded staleness with a 4x slower worker 2, stale updates down-weighted
  paramserver launch -n 4 --mode ssp --staleness-bound 3 --policy inverse \\
      --straggler 2:slowdown=4 --out runs/ssp
\b
  # everything from a file, one option overridden; show what would run
  paramserver launch --config run.toml --mode async --print-config
\b
  # sync across 4 emulated worker hosts and 2 server hosts (root, Linux), every NIC
  # at 400 Mbit/s but worker host 3's at 100 Mbit/s: a network straggler
  paramserver launch -s 2 -n 4 --mode sync --hosts 4+2 --link 400mbit \\
      --link-of 3=100mbit --out runs/slow-nic
\b
  # your own training script (on paramserver.DistributedOptimizer), once per worker
  paramserver launch -s 2 -n 3 --mode sync --out runs/mine -- python train.py --epochs 2
\b
After "--", COMMAND runs once per worker instead of the built-in loop, with
PARAMSERVER_SERVERS, RANK, WORLD_SIZE, LOCAL_RANK and PARAMSERVER_SEED set. Its
DistributedOptimizer takes the straggler options (--straggler, --min-step-time,
...: step() injects the delay), --seed and the client options (timeouts,
--wire-dtype, ...); the options of the built-in loop (--task, --steps,
--epochs, --device, --eval-every, --no-eval, --overlap, ...) are refused.
Failures are handled per --on-worker-failure, result.json's eval is what the
script logged with opt.log(eval_loss=..., eval_accuracy=...), and
DIR/final_model.safetensors holds the servers' final weights.

\b
Each process logs to DIR/logs/<name>.log and writes JSONL events to
DIR/events/; DIR/result.json holds the final loss and accuracy, every
worker's counts and timings and every shard's statistics. The divergence
watchdog's alarms print as they happen (--on-divergence decides whether
they also stop the run); --metrics-port serves Prometheus metrics. Ctrl-C or SIGTERM
stops every process. Exit codes: 0 done, 1 a process failed (the message
names it and shows its log's tail), 2 bad options, 130/143 interrupted.
"""


class _Stop(KeyboardInterrupt):
    """Raised in the main thread by SIGINT or SIGTERM; the cluster stops on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Signals:
    """SIGINT and SIGTERM raise :class:`_Stop` once; repeats are ignored, so the
    clean-up they start cannot itself be interrupted half-way."""

    def __init__(self) -> None:
        self.fired: int | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.fired is None:
            self.fired = signum
            raise _Stop(signum)

    def __enter__(self) -> _Signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class _ProgressView:
    """Feeds the cluster's progress reports into a rich progress bar."""

    def __init__(self, progress: Progress, description: str, total: int | None) -> None:
        self.progress = progress
        self.task = progress.add_task(description, total=total or None, loss="-", rate="-")
        self.window: collections.deque[tuple[float, int]] = collections.deque()

    def __call__(self, report: ClusterProgress) -> None:
        now = time.monotonic()
        done = report.done_steps
        self.window.append((now, done))
        while len(self.window) > 2 and now - self.window[0][0] > 5.0:
            self.window.popleft()
        t0, d0 = self.window[0]
        rate = f"{(done - d0) / (now - t0):.1f}" if now > t0 and done > d0 else "-"
        losses = list(report.last_loss.values())
        loss = f"{sum(losses) / len(losses):.4f}" if losses else "-"
        self.progress.update(self.task, completed=done, loss=loss, rate=rate)


class _AlarmLines:
    """One console line per alarm episode. Every shard sees every push's loss, so a
    loss rule fires on each shard for the same episode (same ``episode`` figure): only
    the first is shown; the event logs keep them all, with every figure."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.shown: set[tuple[Any, ...]] = set()

    def __call__(self, event: dict[str, Any]) -> None:
        from paramserver.wire.stats import AlarmEntry

        alarm = AlarmEntry.of(event)
        figures = alarm.figures
        where = ("episode", figures["episode"]) if "episode" in figures else (
            "shard", alarm.shard, alarm.version)
        key = (alarm.signal, alarm.worker, *where)
        if key in self.shown:
            return
        self.shown.add(key)
        from .watch import format_alarm

        self.console.print(format_alarm(alarm), no_wrap=True, overflow="ellipsis")


def _summary(spec: ClusterSpec, result: ClusterResult, out: Path) -> str:
    from paramserver.workers.launch.results import worker_summaries  # torch: not for --help

    workers = worker_summaries(result)
    # a worker that died and stayed dead wrote no counts: it adds 0 here
    pushes = sum(w.pushes for w in workers)
    accepted = sum(w.accepted for w in workers)
    rejected = sum(w.rejected for w in workers)
    seconds = result.seconds
    what = " ".join(spec.command) if spec.command else spec.worker.task
    plan = spec.host_plan()
    lines = [f"finished in {seconds:.1f}s: {spec.server.mode_spec().describe()}, "
             f"{spec.num_servers} server(s) x {spec.num_workers} worker(s), {what}"
             + (f", on {plan.describe()}" if plan else "")]
    if result.eval:
        lines.append("held-out " + ", ".join(f"{k} {v:.4f}" for k, v in result.eval.items()))
    lines.append(f"pushes {pushes} ({accepted} accepted, {rejected} rejected), "
                 f"{pushes / seconds if seconds else 0:.1f}/s; shard versions "
                 f"{', '.join(str(v) for v in result.updates_applied)}")
    dead = [w for w in workers if not w.finished]
    restarted = [w for w in workers if w.finished and w.restarts]
    if dead or restarted:
        restarts = sum(w.restarts for w in workers)
        lines.append(f"workers: {len(workers) - len(dead)} of {len(workers)} finished, "
                     f"{len(dead)} dead, {restarts} restart(s) "
                     f"(--on-worker-failure {spec.on_worker_failure})")
        lines += [f"  {w.describe()}" for w in dead + restarted]
    if result.alarms:
        episodes = {_episode(a) for a in result.alarms}
        lines.append(f"watchdog alarms: {len(episodes)} ({len(result.alarms)} on all shards;"
                     " events/server*.jsonl; docs/observability.md says what each means)")
    lines.append(f"result: {out / 'result.json'} (logs in {out / 'logs'})")
    if spec.trace:
        lines.append(f"trace: {out / 'trace'} (replay: paramserver simulate --replay {out})")
    return "\n".join(lines)


def _episode(alarm: JSONObject) -> tuple[JSON, ...]:
    """One alarm's episode: every shard raises its own alarm for the same one."""
    figures = alarm.get("figures")
    episode = figures.get("episode") if isinstance(figures, dict) else None
    if episode is None:
        episode = [alarm.get("shard"), alarm.get("version")]
    return (alarm.get("signal"), alarm.get("worker"), json.dumps(episode))


_OWN_LOOP = "your script runs its own loop (give it its own argument after --)"
_OWN_MODEL = "your script builds its model and loads its data"
_OWN_OVERLAP = ("pass overlap=True, bucket_bytes=... to DistributedOptimizer in your script "
                "(which then calls set_num_samples() before backward)")
_OWN_LOCAL = ("pass local=torch.optim.AdamW(model.parameters(), ...), sync_every=H to "
              "DistributedOptimizer in your script")
#: the built-in loop's options that a command run cannot honour, and why (the rest act:
#: on the servers, the launcher, or the script's DistributedOptimizer through
#: LaunchOptions, PARAMSERVER_SEED and PARAMSERVER_EVALUATOR); `launch` and `run` share it
NOT_FOR_COMMANDS: dict[str, str] = {
    "task": _OWN_MODEL, "task_args": _OWN_MODEL, "batch_size": _OWN_MODEL,
    "device": "your script places its model on a device",
    "steps": _OWN_LOOP, "epochs": _OWN_LOOP, "budget_seconds": _OWN_LOOP,
    "push_every": "your script accumulates its gradients (DistributedOptimizer's "
                  "backward_passes_per_step)",
    "eval_every": "your script evaluates when it likes: opt.log(eval_loss=..., "
                  "eval_accuracy=...)",
    "eval": "result.json's eval is what your script logs with opt.log(eval_loss=...), and "
            "the final model is saved either way",
    "overlap": _OWN_OVERLAP, "bucket_bytes": _OWN_OVERLAP,
    "local_optimizer": _OWN_LOCAL, "local_args": _OWN_LOCAL, "sync_every": _OWN_LOCAL,
}


def refuse_for_command(ctx: click.Context) -> None:
    """A one-line UsageError for the first option given as a flag or in --config that
    does not act on a command run. One set in the environment (PARAMSERVER_STEPS, kept
    for built-in runs) is not refused, but said on stderr: never silently ignored."""
    for param in ctx.command.params:
        why = NOT_FOR_COMMANDS.get(param.name or "")
        source = ctx.get_parameter_source(param.name or "")
        if why is None or source in (None, ParameterSource.DEFAULT):
            continue
        off = isinstance(param, click.Option) and param.secondary_opts and \
            not ctx.params.get(param.name or "")
        flag = param.secondary_opts[0] if off else param.opts[0]
        if source is ParameterSource.ENVIRONMENT:
            envvar = getattr(param, "envvar", None) or flag
            click.echo(f"paramserver {ctx.info_name}: {envvar} is set but does not act on a "
                       f"command run: {why}", err=True)
            continue
        given = " (in --config)" if source is ParameterSource.DEFAULT_MAP else ""
        raise click.UsageError(f"{flag}{given} does not act on a command run (after --): "
                               f"{why}", ctx)


def hosts_here() -> None:
    """--hosts: refused in one line (exit 2) where emulated hosts cannot be made."""
    from paramserver.workers.launch import netcluster

    problem = netcluster.netns_problem() or netcluster.tc_problem()
    if problem:
        raise click.UsageError(f"--hosts: {problem} (emulated hosts are network namespaces: "
                               "Linux, as root, with iproute2)")


def _process_line(info: ProcessInfo) -> str:
    return f"{info.name} pid {info.pid}"


def _servers_line(addresses: list[str]) -> str:
    """Where the shards listen, and the `status` command that asks them (it prints
    even with --quiet, as the pids do: it is how to watch the run)."""
    joined = ",".join(addresses)
    return (f"paramserver launch: shards at {joined}; watch them with: paramserver status "
            f"--servers {shlex.quote(joined)}")


def _out_dir(value: str | None, overwrite: bool) -> Path:
    if not value:  # a new folder of its own, even for two launches in the same second
        stamp = Path("runs") / time.strftime("launch-%Y%m%d-%H%M%S")
        stamp.parent.mkdir(parents=True, exist_ok=True)
        for n in range(1, 1000):
            out = stamp if n == 1 else stamp.with_name(f"{stamp.name}-{n}")
            try:
                out.mkdir()  # atomic: the folder is ours
                return out
            except FileExistsError:
                continue
    return claim_out_dir(Path(value or "runs/launch"), what="run", markers=RUN_MARKERS,
                         overwrite=overwrite)


def _resharded_resume(spec: ClusterSpec) -> ClusterSpec:
    """``--resume DIR`` on another shard count than DIR's, checkpointing into DIR: the
    shards reshard it as they load it, and the run checkpoints beside it (said even
    with --quiet: it is where the run's state goes)."""
    from paramserver.persist.reshard import resume_elsewhere

    cfg = spec.server
    with options.user_errors():
        target = resume_elsewhere(cfg.resume, cfg.checkpoint_dir, spec.num_servers)
    if target is None:
        return spec
    click.echo(f"paramserver launch: {cfg.resume} was checkpointed on another number of "
               f"shards; resharded to {spec.num_servers} as it resumes, the run "
               f"checkpoints into {target}", err=True)
    return dataclasses.replace(spec, server=dataclasses.replace(
        cfg, checkpoint_dir=str(target)))


@click.command("launch", epilog=EPILOG,
               short_help="A whole cluster on this machine, start to finish.")
@options.apply_groups("launch")
@options.SERVERS_COUNT
@options.OVERWRITE
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="[-- COMMAND [ARGS]...]")
@click.pass_context
def launch(ctx: click.Context, **opts: Any) -> None:
    """Run a whole cluster on this machine: S servers and N workers, one process each.

    Takes every option of `paramserver server` that sets how shards train
    and every option of `paramserver worker` that sets how workers train;
    addresses, ranks and shard ids are assigned here. After `--`, your own
    script runs as each worker instead (see DistributedOptimizer).
    """
    command = list(opts.pop("command") or ()) or None
    if command:
        refuse_for_command(ctx)
    options.take_deprecated(ctx, opts, "--servers", "num_servers")
    num_servers = opts["num_servers"]
    num_workers = agree_worker_count(ctx, opts, "num_workers")
    stragglers = options.straggler_overrides(opts)
    if stragglers and max(stragglers) >= num_workers:
        raise click.BadParameter(f"worker {max(stragglers)} does not exist: ranks are 0 .. "
                                 f"{num_workers - 1}", param_hint="--straggler")
    with options.user_errors():
        spec = ClusterSpec(
            num_servers=num_servers,
            num_workers=num_workers,
            server=options.server_config(opts, num_shards=num_servers,
                                         expected_workers=num_workers),
            worker=options.worker_config(ctx, opts, servers=[], world_size=num_workers),
            stragglers=stragglers,
            startup_timeout=opts["startup_timeout"],
            run_timeout=opts["run_timeout"],
            stall_warning=opts["stall_warning"],
            evaluate=opts["eval"],
            on_worker_failure="restart" if opts["restart_workers"] else opts["on_worker_failure"],
            restart_servers=opts["restart_servers"],
            max_restarts=opts["max_restarts"],
            metrics_port=opts["metrics_port"],
            tensorboard=opts["tensorboard"],
            command=command,
            hosts=opts["hosts"], link=opts["link"], link_of=dict(opts["link_of"]),
            trace=opts["trace"],
            reshard_at={int(at): to for at, to in parse_reshard_items(
                [f"{at}:{to}" for at, to in opts["reshard_at"]]).items()},
        )
    options.maybe_print_config(ctx, opts)
    spec = _resharded_resume(spec)
    if spec.hosts is not None:
        hosts_here()
    if spec.metrics_port:  # the launcher's own port, then shard i's at PORT + 1 + i
        for port in range(spec.metrics_port, spec.metrics_port + num_servers + 1):
            options.check_port_free("--metrics-port", port)
    out = _out_dir(opts["out"], opts.pop("overwrite"))
    steps = None if command else spec.worker.steps
    from paramserver.cli.progress import cli_console, step_progress
    from paramserver.workers.launch.cluster import run_cluster  # torch, zmq: not for --help

    console = cli_console(stderr=True)
    bar = step_progress(console, "loss {task.fields[loss]}", "{task.fields[rate]} updates/s",
                        disable=opts["quiet"])
    plan = spec.host_plan()
    description = (f"{spec.server.mode_spec().describe()} {num_servers}x{num_workers} "
                   f"{' '.join(command) if command else spec.worker.task}"
                   + (f" on {plan.describe()}" if plan else ""))
    if not opts["quiet"]:
        console.print(f"paramserver launch: {description}; logs and results in {out}",
                      highlight=False)
    set_title(f"launch (run {out})")
    with _Signals():
        try:
            with bar:
                view = _ProgressView(bar, description, steps * num_workers if steps else None)
                # alarms print above the bar as they happen, even with --quiet
                # pids print even with --quiet: they say which process is which
                result = run_cluster(
                    spec, out, on_progress=view,
                    on_alarm=_AlarmLines(console),
                    on_process=lambda info: console.print(
                        f"paramserver launch: started {_process_line(info)}",
                        highlight=False),
                    on_servers=lambda addresses: console.print(
                        _servers_line(addresses), highlight=False))
        except _Stop as stop:
            name = signal.Signals(stop.signum).name
            console.print(f"paramserver launch: {name}: every process stopped; logs in "
                          f"{out / 'logs'}")
            ctx.exit(128 + stop.signum)
        except ParamServerError as exc:
            raise click.ClickException(f"{exc}\n(all logs in {out / 'logs'})") from exc
    click.echo(_summary(spec, result, out))


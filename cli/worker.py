"""``paramserver worker``: one worker, in the foreground."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from paramserver.errors import ConfigError, RemoteError, RequestTimeoutError, TransportError

if TYPE_CHECKING:
    from paramserver.workers.optimizer import WorkerResult

from . import options
from .workercount import agree_worker_count

__all__ = ["worker"]

EPILOG = """\b
Examples:
  # train digits-mlp against two shards started with `paramserver server`
  paramserver worker --servers 127.0.0.1:5600,127.0.0.1:5601 \\
      --rank 0 --world-size 3 --steps 150
\b
  # a straggler: 3x slower, plus exponential delays of 50 ms on average
  paramserver worker --servers 10.0.0.5:5600 --rank 2 --world-size 3 \\
      --slowdown 3 --delay exp:0.05
\b
  # your own task: a factory called as make_task(rank=..., world_size=..., **task args)
  paramserver worker --servers 127.0.0.1:5600 --task mypkg.tasks:make_task \\
      --task-arg hidden=256 --device cuda:0

\b
Workers may start before the servers: each waits up to --timeout seconds
for every shard and then names the one it could not reach. At the end the
worker prints its counts and loss (worker 0 also the held-out accuracy);
--result-file writes them as JSON.
"""


def summary(result: WorkerResult) -> str:
    text = (f"worker {result.worker}: {result.steps} steps ({result.accepted} "
            f"accepted, {result.rejected} rejected), final train loss "
            f"{result.final_train_loss or 0.0:.4f}, {result.seconds:.1f}s")
    metrics = result.eval or {}
    if metrics:
        text += ", held-out " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
    return text


def fail(who: str, exc: Exception) -> click.ClickException:
    """A worker-side error in words a person can act on."""
    if isinstance(exc, RequestTimeoutError):
        return click.ClickException(
            f"{who} gave up waiting for a server: {exc}. Start it (`paramserver server`) or "
            "check the address and firewall; wait longer with --timeout."
        )
    if isinstance(exc, RemoteError):
        return click.ClickException(f"{who}: a server refused: {exc}")
    return click.ClickException(f"{who}: {exc}")


@click.command("worker", epilog=EPILOG,
               short_help="One worker (pulls weights, pushes gradients).")
@options.apply_groups("worker")
@click.pass_context
def worker(ctx: click.Context, **opts: Any) -> None:
    """Run one worker: pull weights, compute gradients, push them, repeat.

    Give every shard's address in shard order (--servers). Workers of one run
    share --world-size and have distinct --rank values, which pick their part
    of the data.
    """
    # the training loop and torch load only when a worker runs, not for --help
    from paramserver.observe.console import Progress
    from paramserver.workers.worker import run_worker, worker_title

    quiet = opts.pop("quiet")
    agree_worker_count(ctx, opts, "world_size")
    config = options.worker_config(ctx, opts)
    options.maybe_print_config(ctx, opts)
    length = f"{config.steps} steps" if config.steps else (
        f"{config.epochs:g} epochs" if config.epochs else "no step cap")
    if config.budget_seconds:
        length += f", a budget of {config.budget_seconds:g}s"
    if not quiet:
        click.echo(f"paramserver: worker {config.rank} of {config.world_size}, {config.task}, "
                   f"{length}; shards at {', '.join(config.servers)}", err=True)
    try:
        worker_title(config)
        # progress from the step records (--quiet: none)
        result = run_worker(config, None if quiet else Progress())
    except ConfigError as exc:  # raised inside the task factory, say
        raise click.UsageError(str(exc)) from exc
    except (TransportError, RemoteError) as exc:
        raise fail(f"worker {config.rank}", exc) from exc
    click.echo(summary(result))


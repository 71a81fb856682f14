"""``paramserver server``: one shard server, in the foreground."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from paramserver.errors import ConfigError, TransportError
from paramserver.server.config import NO_REPLICATION_KEY

from . import options
from .workercount import agree_worker_count

if TYPE_CHECKING:
    from paramserver.server.config import ServerConfig

__all__ = ["server"]

EPILOG = """\b
Examples:
  # two shards on this machine, fixed ports, sync training for 3 workers
  paramserver server --shard 0 --num-shards 2 --port 5600 \\
      --mode sync --expected-workers 3
  paramserver server --shard 1 --num-shards 2 --port 5601 \\
      --mode sync --expected-workers 3

\b
  # accept workers from other hosts; bounded staleness; down-weight late updates
  paramserver server --host 0.0.0.0 --port 5600 --mode ssp --staleness-bound 2 \\
      --policy inverse --optimizer adam --lr 0.001

\b
  # a shard with a backup (--replicas 1): one replication key for the run, the
  # backup first, then the primary, given its backup's address; workers get the
  # replicas joined by |
  paramserver keys replication run.key
  paramserver server --replicas 1 --replica 1 --port 5611 --expected-workers 2 \\
      --replication-key run.key
  paramserver server --replicas 1 --replica 0 --port 5610 --replication-key run.key \\
      --replica-peers 127.0.0.1:5611 --expected-workers 2
  paramserver worker --servers '127.0.0.1:5610|127.0.0.1:5611' --rank 0 --world-size 2

\b
The server prints one line on stdout when it listens,
  PARAMSERVER_READY tcp://HOST:PORT pid=PID [metrics=PORT]
for scripts, and the run's story on stderr for you: listening, training
started, each worker joined, dead or rejoined (and at which clock),
checkpoints, all workers done (--quiet: none of it). It serves until Ctrl-C
(SIGINT) or SIGTERM, then exits with code 0. Workers connect with
`paramserver worker --servers ADDR0,ADDR1,...` (addresses in shard order;
a replicated shard's replicas joined by |). A replica started in place of a
dead one is given the live replicas as --replica-peers and joins their
primary as a backup.
"""


#: replica 0 started by hand without its backups
NO_PEERS = ("--replicas: replica 0 (the shard's first primary) needs --replica-peers with "
            "its backups' addresses; start each backup first with --replica K (1 .. R)")


def ready_printer(config: ServerConfig, sentence: bool = True) -> Any:
    """on_ready callback: the machine-readable line on stdout, and (``sentence``) one on
    stderr for people; ``paramserver server``'s console says it instead (its server_start)."""
    from paramserver.server.process import Ready, announce_ready

    def on_ready(ready: Ready) -> None:
        announce_ready(ready)
        if not sentence:
            return
        address, metrics_port = ready.address, ready.metrics_port
        metrics = (f" Metrics: http://{address.split('://')[-1].rsplit(':', 1)[0]}:"
                   f"{metrics_port}/metrics." if metrics_port is not None else "")
        click.echo(
            f"paramserver: shard {config.shard} of {config.num_shards} listening on {address} "
            f"({config.mode_spec().describe()}, policy {config.policy}, optimizer "
            f"{config.optimizer}); waiting for {config.expected_workers} worker(s).{metrics} "
            "Stop with Ctrl-C.",
            err=True,
        )

    return on_ready


@click.command("server", epilog=EPILOG,
               short_help="One shard server (holds a slice of the weights).")
@options.apply_groups("server")
@click.pass_context
def server(ctx: click.Context, **opts: Any) -> None:
    """Run one shard server: it holds a slice of the weights and their optimizer.

    Start one per shard (--shard 0 .. --num-shards - 1); every worker talks to
    all of them. It binds 127.0.0.1 unless --host says otherwise.
    """
    quiet = opts.pop("quiet")
    agree_worker_count(ctx, opts, "expected_workers")
    config = options.server_config(opts)
    if config.replicas and config.replica == 0 and not config.replica_peers:
        with options.user_errors():  # (launch and run wire the replicas themselves)
            raise ConfigError(NO_PEERS)
    if config.replicas and not (config.replication_key or config.curve_secret_key):
        with options.user_errors():  # (launch and run make a key per run)
            raise ConfigError(NO_REPLICATION_KEY)
    # the server's loop, zmq and the checkpoints load only when one runs, not for --help
    from paramserver.observe.console import Console
    from paramserver.persist.checkpoint import CheckpointDirInUse, CheckpointError
    from paramserver.server.entry import run_server

    options.maybe_print_config(ctx, opts)
    options.check_port_free("--metrics-port", config.metrics_port,
                            config.bind.split("://", 1)[-1].rsplit(":", 1)[0])
    try:
        # the run's story on stderr, one line per event that matters (--quiet: none)
        code = run_server(config, ready_printer(config, sentence=False),
                          console=None if quiet else Console.to_stream())
    except (TransportError, ConfigError) as exc:  # the port is in use, replicas disagree
        raise click.ClickException(f"shard {config.shard}: {exc}") from exc
    except CheckpointDirInUse as exc:  # an earlier run's checkpoints: --resume or --fresh
        raise click.ClickException(f"shard {config.shard}: {exc}") from exc
    except CheckpointError as exc:  # --resume from a bad checkpoint: one line, no traceback
        raise click.ClickException(f"shard {config.shard}: cannot resume: {exc}") from exc
    ctx.exit(code)  # 0, or 3 when the watchdog stopped training (--on-divergence)


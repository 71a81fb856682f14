"""``paramserver reshard``: move a running job's shards to another shard count, live."""

from __future__ import annotations

import json
from pathlib import Path

import click

from paramserver.core.limits import MAX_PLAN_SERVERS

from . import options
from .paramtypes import ShardList

__all__ = ["reshard"]

EPILOG = """\b
Examples:
  # grow 2 shards to 4: start two empty shards first, with the job's options
  paramserver server --shard 2 --num-shards 4 --mode sync --expected-workers 3 \\
      --port 5602 &
  paramserver server --shard 3 --num-shards 4 --mode sync --expected-workers 3 \\
      --port 5603 &
  paramserver reshard --servers 127.0.0.1:5600,127.0.0.1:5601 --to 4 \\
      --add 127.0.0.1:5602,127.0.0.1:5603
  # shrink 4 to 3 at sync round 100: the fourth shard hands off and stops
  paramserver reshard --servers 127.0.0.1:5600,127.0.0.1:5601,127.0.0.1:5602,127.0.0.1:5603 \\
      --to 3 --at 100
  # under CURVE: the admin key, as for SHUTDOWN
  paramserver reshard --servers 10.0.0.5:5600,10.0.0.6:5600 --to 1 \\
      --curve-key keys/ops.key_secret --curve-server-key keys/server.key

\b
The shards stop at one cut (sync: a round boundary, --at or the next; async and
SSP: now, every push one shard took taken by all), send their state here, and
each shard of the new plan is sent its part (weights, optimizer state, scheduler,
clocks, push-id windows: docs/reliability.md, "Elastic servers"). Only once every
one holds it do they switch; the workers learn the new plan from their next
request and go on without restarting. A move that fails before any shard
switched (a new shard that does not answer within --timeout) leaves the old plan
serving, nothing lost; an old shard lost mid-move calls it off, the others serve
on, and the line names the lost one (restart it from a checkpoint). The new plan
is the first S of --servers, then --add. Refused in one line: replicated shards,
sparse tables, backup workers, compressed pulls, --trace, and the policies that
keep statistics per shard (dc-asgd-adaptive, gap-aware, ssp-adaptive). Prints
the move's pause; exit code 1 if it failed.
"""


@click.command("reshard", epilog=EPILOG,
               short_help="Move a running job to another number of shards, live.")
@click.option("--servers", type=ShardList(), multiple=True, required=True,
              envvar=options.envvar("servers"), show_envvar=True,
              help="Every shard's address now, in shard order: comma-separated or repeated.")
@click.option("--to", "to", type=click.IntRange(min=1, max=MAX_PLAN_SERVERS), required=True,
              metavar="S", help="The new number of shards (at most 1024).")
@click.option("--add", type=ShardList(), multiple=True,
              help="Addresses of the shards a move to more adds (started, empty), in order.")
@click.option("--at", type=click.IntRange(min=-1), default=-1, show_default=True,
              metavar="ROUND", help="Sync: move once ROUND rounds closed (-1: the next "
                                    "boundary). Async and SSP move at once.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=60.0,
              show_default=True, metavar="SECONDS",
              help="How long each step's answers, and the cut, are waited for.")
@click.option("--curve-key", type=click.Path(dir_okay=False, path_type=Path),
              help="CURVE: the admin's secret key file (the servers' --admin-key).")
@click.option("--curve-server-key", type=click.Path(dir_okay=False, path_type=Path),
              help="CURVE: the servers' public key file.")
@click.option("--json", "as_json", is_flag=True, help="Print the move's report as JSON.")
def reshard(servers: tuple[tuple[str, ...], ...], to: int, add: tuple[tuple[str, ...], ...],
            at: int, timeout: float, curve_key: Path | None, curve_server_key: Path | None,
            as_json: bool) -> None:
    """Move a running job's shards to another shard count without stopping it."""
    from paramserver.errors import ConfigError, TransportError
    from paramserver.wire.curve import CurveKeys
    from paramserver.workers.reshard import MoveFailed, live_reshard

    if bool(curve_key) != bool(curve_server_key):
        raise click.UsageError("CURVE needs both --curve-key and --curve-server-key")
    try:
        curve = CurveKeys.load(curve_key, curve_server_key) if curve_key else None
    except (TransportError, OSError) as exc:
        raise click.UsageError(f"--curve-key: {exc}") from None
    old = [a if "://" in a else f"tcp://{a}" for a in options.flatten_addresses(servers)]
    new = [a if "://" in a else f"tcp://{a}" for a in options.flatten_addresses(add)]
    if any("|" in a for a in old):
        raise click.UsageError("a live reshard of replicated shards is not supported: "
                               "checkpoint, `paramserver checkpoint reshard`, resume")
    try:
        report = live_reshard(old, to, new, at=at, timeout=timeout, curve=curve,
                              progress=lambda text: click.echo(text, err=True))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    except (MoveFailed, TransportError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps({**report.__dict__, "servers": list(report.servers)}, indent=2))
    else:
        click.echo(report.describe())
        click.echo(f"servers now: {','.join(report.servers)}")

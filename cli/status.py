"""``paramserver status``: what every shard of a running cluster is doing."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from . import options
from .paramtypes import ShardList

__all__ = ["status"]

EPILOG = """\b
Examples:
  paramserver status --servers 127.0.0.1:5600,127.0.0.1:5601
  paramserver status --servers 127.0.0.1:5600,127.0.0.1:5601 --watch
  PARAMSERVER_SERVERS="127.0.0.1:5600 127.0.0.1:5601" paramserver status
  paramserver status --servers 10.0.0.5:5600 --json | jq '.[0].version'
  # shards with replicas (launch --replicas 1): each shard's replicas joined by |
  paramserver status --servers '127.0.0.1:5600|127.0.0.1:5602,127.0.0.1:5601|127.0.0.1:5603'

\b
Per shard: its version (optimizer steps applied), mode and policy, the
workers it knows with their clocks (pushes done) and state (live, done,
dead), the pushes it applied and rejected, the largest staleness it saw, and
watchdog alarms; for a shard given with its replicas, which one is primary,
the epoch, and how long ago each backup acknowledged. Reading the status does
not register with the shard and changes nothing. Exit code 1 if a shard did
not answer within --timeout.
"""


@click.command("status", epilog=EPILOG,
               short_help="Each shard's version, workers, clocks, counts.")
@click.option("--servers", type=ShardList(), multiple=True, required=True,
              envvar=options.envvar("servers"), show_envvar=True,
              help="Every shard's address: comma-separated or repeated; a shard with "
                   "replicas as its replicas' addresses joined by |.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=5.0,
              show_default=True, metavar="SECONDS", help="How long to wait for each shard.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw statistics as JSON.")
@click.option("--watch", is_flag=True, help="Refresh the table until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              metavar="SECONDS", help="Seconds between refreshes with --watch.")
def status(servers: tuple[tuple[str, ...], ...], timeout: float, as_json: bool, watch: bool,
           interval: float) -> None:
    """Show each shard's version, mode, live workers and their clocks, and update counts."""
    # rich, ZeroMQ and the STATS record load when the status is read, not for --help
    from rich.live import Live

    from paramserver.cli.progress import cli_console

    from .statusview import collect, find_primaries, render, replica_roles

    def draw() -> Any:
        addresses, roles = find_primaries(entries, timeout)
        rows, problems = collect(addresses, timeout)
        return render(addresses, rows, problems, console, roles)

    entries = options.flatten_addresses(servers)
    if as_json and watch:
        raise click.UsageError("--watch draws a table; use --json without it")
    console = cli_console()
    if not console.is_terminal:  # a pipe or a file: no need to squeeze into 80 columns
        console = cli_console(width=200)
    if watch:
        with Live(draw(), console=console, auto_refresh=False) as live:
            try:
                while True:
                    time.sleep(interval)  # the refresh period, not a synchronisation
                    live.update(draw(), refresh=True)
            except KeyboardInterrupt:
                return
    addresses, roles = find_primaries(entries, timeout)
    rows, problems = collect(addresses, timeout)
    if as_json:
        click.echo(json.dumps([{**(r.to_dict() if r is not None
                                   else {"address": a, "error": "no reply"}),
                                **({"replicas": replica_roles(shard)} if shard else {})}
                               for r, a, shard in zip(rows, addresses, roles, strict=True)],
                              indent=2))
    else:
        console.print(render(addresses, rows, [] if problems else problems, console, roles))
    if problems:
        raise click.ClickException("; ".join(problems))

"""``paramserver status``: what every shard of a running cluster is doing."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

import click
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from paramserver.errors import RemoteError, RequestTimeoutError, TransportError
from paramserver.wire.stats import ShardStats, WorkerStats
from paramserver.workers.admin import server_stats

from . import options
from .tables import keep_figures
from .watch import health_table, worker_table

__all__ = ["status"]

EPILOG = """\b
Examples:
  paramserver status --servers 127.0.0.1:5600,127.0.0.1:5601
  paramserver status --servers 127.0.0.1:5600,127.0.0.1:5601 --watch
  PARAMSERVER_SERVERS="127.0.0.1:5600 127.0.0.1:5601" paramserver status
  paramserver status --servers 10.0.0.5:5600 --json | jq '.[0].version'

\b
Per shard: its version (optimizer steps applied), mode and policy, the
workers it knows with their clocks (pushes done) and state (live, done,
dead), the pushes it applied and rejected, the largest staleness it saw, and
watchdog alarms. Reading the status does not register with the shard and
changes nothing. Exit code 1 if a shard did not answer within --timeout.
"""


def _worker_cell(workers: Mapping[str, WorkerStats]) -> str:
    cells = []
    for wid, w in sorted(workers.items(), key=lambda kv: int(kv[0])):
        state = "" if w.live else (" done" if w.finished else " dead")
        cells.append(f"w{wid}:{w.clock}{state}")
    return " ".join(cells) or "-"


def _counts(workers: Mapping[str, WorkerStats]) -> tuple[int, int, int]:
    applied = sum(w.applied for w in workers.values())
    rejected = sum(sum(w.rejected.values()) for w in workers.values())
    stale = max((w.staleness_max for w in workers.values()), default=0)  # exact
    return applied, rejected, stale


def collect(addresses: list[str], timeout: float) -> tuple[list[ShardStats | None], list[str]]:
    """Each shard's statistics (None where it did not answer) and the problems, in words."""
    rows: list[ShardStats | None] = []
    problems = []
    for i, address in enumerate(addresses):
        try:
            row = server_stats([address], timeout)[0]
        except RequestTimeoutError:
            problem = f"no reply within {timeout:g}s (is it running and reachable?)"
        except RemoteError as exc:
            problem = f"refused: {exc.code}: {exc.reason}"
        except TransportError as exc:
            problem = str(exc)
        else:
            rows.append(row)
            if row.shard != i:
                problems.append(f"{address} is shard {row.shard}, but was given in place {i}: "
                                "give the addresses in shard order")
            continue
        rows.append(None)
        problems.append(f"shard {i} at {address}: {problem}")
    return rows, problems


def render(addresses: list[str], rows: list[ShardStats | None],
           problems: list[str], console: Console) -> Group:
    """The shards' table, then per shard and per worker figures: fitted to ``console``,
    never cutting an address or a figure."""
    table = Table(title=f"{len(addresses)} shard(s), {time.strftime('%H:%M:%S')}")
    numeric = ("shard", "version", "applied", "rejected", "max staleness", "waiting", "alarms")
    for column in ("shard", "address", "mode", "policy", "version", "workers (clock)",
                   "applied", "rejected", "max staleness", "waiting", "alarms"):
        table.add_column(column, justify="right" if column in numeric else "left")
    notes = []
    for i, (row, address) in enumerate(zip(rows, addresses, strict=True)):
        if row is None:
            table.add_row(str(i), address, "[red]no reply[/red]", *["-"] * 8)
            continue
        applied, rejected, stale = _counts(row.workers)
        alarms = row.observed.alarms
        if alarms:
            notes.append(f"shard {row.shard}: last alarm: {alarms[-1].message}")
        core = row.figures  # None: no plan yet
        table.add_row(str(row.shard), address, row.mode, row.policy, str(row.version),
                      _worker_cell(row.workers), str(applied), str(rejected), str(stale),
                      str(core.pending_pulls if core else 0), str(row.observed.alarm_count))
    answered = [row for row in rows if row is not None]
    figures = [health_table(answered), worker_table(answered)] if answered else []
    return Group(*(keep_figures(t, console, whole=("address", "host:pid"))
                   for t in (table, *figures)), *(Text(n) for n in notes),
                 *(Text(p, style="red") for p in problems))


@click.command("status", epilog=EPILOG,
               short_help="Each shard's version, workers, clocks, counts.")
@click.option("--servers", type=options.AddressList(), multiple=True, required=True,
              envvar=options.envvar("servers"), show_envvar=True,
              help="Every shard's address: comma-separated or repeated.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=5.0,
              show_default=True, metavar="SECONDS", help="How long to wait for each shard.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw statistics as JSON.")
@click.option("--watch", is_flag=True, help="Refresh the table until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              metavar="SECONDS", help="Seconds between refreshes with --watch.")
def status(servers: tuple[tuple[str, ...], ...], timeout: float, as_json: bool, watch: bool,
           interval: float) -> None:
    """Show each shard's version, mode, live workers and their clocks, and update counts."""
    addresses = options.flatten_addresses(servers)
    if as_json and watch:
        raise click.UsageError("--watch draws a table; use --json without it")
    console = Console()
    if not console.is_terminal:  # a pipe or a file: no need to squeeze into 80 columns
        console = Console(width=200)
    if watch:
        with Live(render(addresses, *collect(addresses, timeout), console), console=console,
                  auto_refresh=False) as live:
            try:
                while True:
                    time.sleep(interval)
                    live.update(render(addresses, *collect(addresses, timeout), console),
                                refresh=True)
            except KeyboardInterrupt:
                return
    rows, problems = collect(addresses, timeout)
    if as_json:
        click.echo(json.dumps([r.to_dict() if r is not None
                               else {"address": a, "error": "no reply"}
                               for r, a in zip(rows, addresses, strict=True)], indent=2))
    else:
        console.print(render(addresses, rows, [] if problems else problems, console))
    if problems:
        raise click.ClickException("; ".join(problems))

"""What ``paramserver status`` reads and draws: each shard's STATS (:func:`collect`) as
tables fitted to the terminal (:func:`render`). Apart from status.py, which imports
this only when it runs, so that ``status --help`` loads neither rich nor the STATS
record (and through it torch).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import msgspec
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from paramserver.errors import RemoteError, RequestTimeoutError, TransportError
from paramserver.util.jsontypes import JSONObject
from paramserver.wire.replication import RoleReply
from paramserver.wire.stats import ShardStats, WorkerStats
from paramserver.workers.admin import server_stats
from paramserver.workers.failover import SEPARATOR, ask_roles, primary_of

from .tables import keep_figures
from .watch import health_table, worker_table

__all__ = ["collect", "find_primaries", "render", "replica_roles", "replica_table"]


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


#: per shard, each replica's address and its answer (None: none); empty without replicas
Roles = list[list[tuple[str, RoleReply | None]]]


def find_primaries(entries: list[str], timeout: float) -> tuple[list[str], Roles]:
    """Each shard's address (given with its replicas joined by ``|``: its primary's now)
    and each shard's replicas' roles (empty for a shard given by one address)."""
    roles: Roles = []
    addresses = []
    for entry in entries:
        replicas = entry.split(SEPARATOR)
        asked = ask_roles(replicas, min(timeout, 1.0)) if len(replicas) > 1 else {}
        roles.append(list(asked.items()))
        primary = primary_of(asked)
        addresses.append(primary[0] if primary else replicas[0])
    return addresses, roles


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


def replica_roles(shard: list[tuple[str, RoleReply | None]]) -> list[JSONObject]:
    """One shard's replicas for ``status --json``."""
    return [{"address": a, **(msgspec.to_builtins(r) if r is not None else {"error": "no reply"})}
            for a, r in shard]


def replica_table(roles: Roles) -> Table:
    """Each replica of each replicated shard: role, epoch, inputs applied, and (for a
    primary) how long ago each backup last acknowledged."""
    table = Table(title="replicas")
    for column in ("shard", "address", "role", "epoch", "applied", "backups (lag, last ack)",
                   "failovers"):
        table.add_column(column, justify="right" if column in ("shard", "epoch", "applied",
                                                                "failovers") else "left")
    for shard, replicas in enumerate(roles):
        for address, r in replicas:
            if r is None:
                table.add_row(str(shard), address, "[red]no reply[/red]", *["-"] * 4)
                continue
            lag = ", ".join(f"{a.rsplit(':', 1)[-1]}: {n} behind, {s:.2f}s"
                            for a, s, n in zip(r.backups, r.lag, r.behind, strict=False)) or "-"
            role = f"[bold]{r.role}[/bold]" if r.role == "primary" else r.role
            table.add_row(str(shard), address, role, str(r.epoch), str(r.applied), lag,
                          str(r.failovers))
    return table


def render(addresses: list[str], rows: list[ShardStats | None],
           problems: list[str], console: Console, roles: Roles | None = None) -> Group:
    """The shards' table, then per shard and per worker figures: fitted to ``console``,
    never cutting an address or a figure."""
    # a live reshard raised the plan epoch (paramserver reshard): shown when one did
    epochs = sorted({int(r.counters.get("plan_epoch", 0)) for r in rows if r is not None})
    epoch = f", plan epoch {'/'.join(map(str, epochs))}" if any(epochs) else ""
    table = Table(title=f"{len(addresses)} shard(s){epoch}, {time.strftime('%H:%M:%S')}")
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
    if roles and any(roles):
        figures.append(replica_table(roles))
    return Group(*(keep_figures(t, console, whole=("address", "host:pid"))
                   for t in (table, *figures)), *(Text(n) for n in notes),
                 *(Text(p, style="red") for p in problems))

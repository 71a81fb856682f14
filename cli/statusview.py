"""What ``paramserver status`` reads and draws: each shard's STATS (:func:`collect`) as
tables fitted to the terminal (:func:`render`). Apart from status.py, which imports
this only when it runs, so that ``status --help`` loads neither rich nor the STATS
record (and through it torch).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from paramserver.errors import RemoteError, RequestTimeoutError, TransportError
from paramserver.wire.stats import ShardStats, WorkerStats
from paramserver.workers.admin import server_stats

from .tables import keep_figures
from .watch import health_table, worker_table

__all__ = ["collect", "render"]


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

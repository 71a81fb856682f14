"""Rendering for the live views: ``paramserver status --watch`` and alarms in ``launch``.

Pure presentation over STATS replies (``paramserver.workers.client.server_stats``) and
alarm records (``alarm`` events); the commands own the options and the loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from paramserver.cli.progress import cli_console
from paramserver.wire.stats import AlarmEntry, ShardStats

from .tables import keep_figures

__all__ = ["format_alarm", "health_table", "render_status", "watch_status", "worker_table"]


def _num(value: float | None, fmt: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, fmt)


def _measured(one_in: int) -> Text:
    if one_in <= 1:
        return Text("all")
    return Text(f"1 in {one_in}", style="yellow")


def health_table(stats: Sequence[ShardStats]) -> Table:
    """Per shard: version, clocks and what the last optimizer step did to the weights."""
    table = Table(title="per shard: the last step", title_justify="left", expand=False)
    for col in ("shard", "mode", "version", "live", "min clock", "gap", "lr",
                "update/weight", "weight norm", "measured", "alarms"):
        table.add_column(col, justify="left" if col in ("mode",) else "right")
    for s in stats:
        core = s.figures  # None: no plan yet
        step = s.observed.step
        alarms = s.observed.alarm_count
        # the last step's, else (none yet) the core's own
        lr = step.lr if step.lr is not None else core.lr if core else None
        norm = step.weight_norm if step.weight_norm is not None else \
            core.weight_norm if core else None
        table.add_row(
            str(s.shard), s.mode, str(s.version),
            str(len(core.live_workers) if core else 0), str(core.min_clock if core else "-"),
            str(core.clock_gap if core else "-"), _num(lr), _num(step.update_ratio), _num(norm),
            # pushes measured in full: all, or one in N per worker (observe_budget)
            _measured(s.measured_one_in),
            Text(str(alarms), style="bold red" if alarms else ""),
        )
    return table


@dataclass
class _Row:
    """One worker's figures combined over shards."""

    clock: int = 0
    lag: int = 0
    pushes: int = 0
    applied: int = 0
    rejected: int = 0
    stale: dict[str, int] = field(default_factory=dict)  # {tau: count} over shards
    stale_sum: int = 0
    stale_max: int = 0
    grad_sq: float = 0.0  # a gradient's squared norm, summed over its slices
    cosines: list[float] = field(default_factory=list)
    loss: float | None = None
    wait: float = 0.0
    live: bool = True
    weight: list[float] = field(default_factory=list)
    where: set[str] = field(default_factory=set)  # host:pid as each shard heard it

    def staleness(self) -> tuple[float | None, int | None]:
        """(mean, max) staleness, exact from the shards' sums and maxima."""
        total = sum(self.stale.values())
        return (self.stale_sum / total, self.stale_max) if total else (None, None)


def _worker_rows(stats: Sequence[ShardStats]) -> dict[int, _Row]:
    """Per worker, figures combined over shards (a gradient's norm over all its slices)."""
    rows: dict[int, _Row] = {}
    for s in stats:
        core = s.figures
        if core is None:
            continue
        observed = s.observed.workers
        for key, w in core.workers.items():
            r = rows.setdefault(int(key), _Row())
            r.clock = max(r.clock, w.clock)
            if w.pid is not None:  # a worker the shard has not heard say HELLO
                r.where.add(f"{w.host or '?'}:{w.pid}")
            if w.live and not w.finished:
                r.lag = max(r.lag, w.clock - core.min_clock)
            else:
                r.live = False
            r.pushes = max(r.pushes, w.pushes)
            r.applied += w.applied
            r.rejected += sum(w.rejected.values())
            r.wait += w.wait_seconds
            if w.applied:
                r.weight.append(w.mean_weight)
            for tau, n in w.staleness.items():
                r.stale[tau] = r.stale.get(tau, 0) + n
            r.stale_sum += w.staleness_sum
            r.stale_max = max(r.stale_max, w.staleness_max)
            o = observed.get(key)
            if o is None:
                continue
            if o.grad_norm is not None:
                r.grad_sq += o.grad_norm ** 2
            if o.cosine is not None:
                r.cosines.append(o.cosine)
            if o.loss is not None:
                r.loss = o.loss
    return rows


def worker_table(stats: Sequence[ShardStats]) -> Table:
    """Per worker, over all shards: clock, lag, staleness, counts, gradient, loss."""
    table = Table(title="workers (over all shards)", title_justify="left")
    for col in ("worker", "host:pid", "live", "clock", "lag", "staleness mean/max", "applied",
                "rejected", "mean weight", "grad norm", "cosine", "loss", "waited s"):
        table.add_column(col, justify="left" if col == "host:pid" else "right")
    for worker, r in sorted(_worker_rows(stats).items()):
        mean, high = r.staleness()
        cosine = sum(r.cosines) / len(r.cosines) if r.cosines else None
        weight = sum(r.weight) / len(r.weight) if r.weight else None
        # shards that disagree (one saw the worker before a restart) show both
        table.add_row(
            str(worker), " ".join(sorted(r.where)) or "-",
            "yes" if r.live else Text("no", style="dim"), str(r.clock),
            str(r.lag), f"{_num(mean, '.2f')}/{_num(high, 'd')}", str(r.applied),
            Text(str(r.rejected), style="yellow" if r.rejected else ""),
            _num(weight, ".2f"), _num(math.sqrt(r.grad_sq) if r.grad_sq else None),
            Text(_num(cosine, ".2f"), style="red" if cosine is not None and cosine < 0 else ""),
            _num(r.loss, ".4g"), _num(r.wait, ".1f"),
        )
    return table


def format_alarm(alarm: AlarmEntry) -> Text:
    """One alarm (an ``alarm`` event or STATS entry) as a red line for the console."""
    return Text.assemble(("ALARM ", "bold red"), (alarm.message, "red"))


def render_status(stats: Sequence[ShardStats], *, alarms: int = 5,
                  title: str = "", console: Console | None = None) -> Group:
    """Shards, workers and the latest alarms of a run, from each shard's STATS reply;
    with ``console``, tables fitted to its width without cutting a figure."""
    parts: list[RenderableType] = []
    if title:
        parts.append(Text(title, style="bold"))
    tables = [health_table(stats), worker_table(stats)]
    parts += [keep_figures(t, console, whole=("host:pid",)) for t in tables] if console \
        else tables
    recent = [a for s in stats for a in s.observed.alarms]
    if recent:
        parts.append(Text("latest alarms", style="bold"))
        parts += [format_alarm(a) for a in recent[-alarms:]]
    return Group(*parts)


def watch_status(fetch: Callable[[], Sequence[ShardStats]], *, interval: float = 1.0,
                 count: int | None = None, console: Console | None = None) -> None:
    """Redraw :func:`render_status` every ``interval`` seconds until Ctrl-C (or ``count``
    refreshes). ``fetch`` returns the STATS replies; a failure shows as the title."""
    console = console or cli_console()
    done = 0
    with Live(console=console, auto_refresh=False, transient=False) as live:
        try:
            while count is None or done < count:
                stamp = time.strftime("%H:%M:%S")
                try:
                    stats = fetch()
                    live.update(render_status(stats, title=f"paramserver status  {stamp}",
                                              console=console), refresh=True)
                except Exception as exc:  # a shard down must not end the view
                    live.update(Text(f"{stamp}  cannot reach the servers: {exc}", style="red"),
                                refresh=True)
                done += 1
                if count is None or done < count:
                    time.sleep(interval)  # the refresh period of the view
        except KeyboardInterrupt:
            pass
